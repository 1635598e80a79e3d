"""Plants the fault named in SHARDWISE_PLANTED_FAULT at interpreter start-up (tests/planted.py).
Only on PYTHONPATH for a launched process of a planted test (`planted.fault_env`).

Python runs the first `sitecustomize` on the path only; a launched test may bring its own
start-up further down the path (tests/stand_ins: a seed, a stand-in module), so the next one
found runs first, then the fault is planted."""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _next = os.path.join(os.path.abspath(_entry or "."), "sitecustomize.py")
    if os.path.dirname(_next) != _HERE and os.path.isfile(_next):
        _spec = importlib.util.spec_from_file_location("_next_sitecustomize", _next)
        if _spec is not None and _spec.loader is not None:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break

if os.environ.get("SHARDWISE_PLANTED_FAULT"):
    import planted

    planted.plant(os.environ["SHARDWISE_PLANTED_FAULT"])
