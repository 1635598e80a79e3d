"""The processes: where this one sits, its device and the data-parallel mesh (`world`),
collectives with shapes checked (`collectives`), whether every process makes a call (`arrival`),
and the one module that touches torch's private names (`internals`)."""
