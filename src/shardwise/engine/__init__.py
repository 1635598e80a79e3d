"""The `Engine` (`engine`, with its model verbs in `models` and process verbs in `process`), the
session below it (`session`: the prepare pipeline and the step), the step protocol (`step`), the
prepared optimizer and scheduler (`optim`), DataLoaders (`data`), the token-weighted loss
(`items`), the loop's rules (`loop_rules`) and the loop state a checkpoint keeps (`loop_state`)."""

from .engine import Engine as Engine, set_seed as set_seed
