"""The code route (a notebook, a script run by plain torchrun): `python in_code.py ROUTE ARGS...`
puts the Trainer on shardwise in code, then runs train_clm.py with ARGS.

ROUTE "install": `shardwise.trainer.install(strategy="zero3")`, the one line before any Trainer
is built (every Trainer, TRL's too, runs on shardwise). ROUTE "mixin": the script's `Trainer` is
`shardwise.trainer.ShardwiseTrainer` (`class ShardwiseTrainer(TrainerMixin, Trainer)`; TRL's
classes compose the same way: `class MySFT(TrainerMixin, SFTTrainer)`), its settings from
SHARDWISE_CONFIG."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

route = sys.argv.pop(1)
script = Path(__file__).with_name("train_clm.py")
sys.argv[0] = str(script)
if route == "install":
    import shardwise.trainer

    shardwise.trainer.install(strategy="zero3")
    runpy.run_path(str(script), run_name="__main__")
else:
    import train_clm

    from shardwise.trainer import ShardwiseTrainer

    train_clm.Trainer = ShardwiseTrainer  # the script as if written `ShardwiseTrainer(model=..., ...)`
    train_clm.main()
# the script's end: `trainer.end()` in a script that keeps its trainer; here, each open one (the
# launch route does this itself after the script)
from shardwise.trainer.routes import end_open  # noqa: E402

end_open()
