"""Checkpoints: the engine's `CheckpointManager` (`manager`: naming, run lock, background writer,
resume), sharded save and load with resharding (`sharded`), the folder format, its checksums and
safe reading (`files`), folder naming and pruning (`naming`: step_<N>, Accelerate's
checkpoint_<i>), the writer of `checkpoint_async` (`background`), what every save shares
(`storage`: staging, atomic exchange, one-line errors; `shardwise.weights.storage` under this
package's name), what a checkpoint asks of the engine (`parts`: `Parts` and the owners of model
and optimizer state), one run per folder (`runlock`) and the launcher's record of the saves
(`run_record`)."""

from .storage import CheckpointError as CheckpointError
