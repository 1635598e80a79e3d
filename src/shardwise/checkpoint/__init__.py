"""Checkpoints: sharded save and load with resharding (`sharded`), the folder format, its
checksums and safe reading (`files`), the background writer of `checkpoint_async` (`background`),
what every save shares (`storage`: staging, atomic exchange, one-line errors) and one run per
folder (`runlock`)."""

from .storage import CheckpointError as CheckpointError
