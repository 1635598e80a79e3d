"""Start-up for launched real client scripts (only on PYTHONPATH for their tests).

- `STAND_IN_SEED`: torch seeded at interpreter start-up, in the launcher and every worker. A
  script that seeds nothing itself (diffusers' train_unconditional.py builds its model from
  torch's unseeded generator) then starts two runs (under Accelerate and under shardwise) from
  the same weights and draws the same noise.
- `STAND_IN_TORCHVISION`: `import torchvision` in the script itself (its `__main__`) gets the
  stand-in of `tests/stand_ins/_torchvision` (see its docstring); anything else that looks for
  torchvision (transformers' availability checks) finds none, as on this machine.
"""

import os
import sys

if os.environ.get("STAND_IN_SEED"):
    import torch

    torch.manual_seed(int(os.environ["STAND_IN_SEED"]))

if os.environ.get("STAND_IN_TORCHVISION"):
    import importlib.abc
    import importlib.util
    from pathlib import Path

    _HERE = Path(__file__).resolve().parent / "_torchvision"

    class _StandIn(importlib.abc.MetaPathFinder):
        """torchvision and its submodules, from the stand-in."""

        def find_spec(self, name, path=None, target=None):
            if name != "torchvision" and not name.startswith("torchvision."):
                return None
            where = _HERE.joinpath(*name.split(".")[1:])
            file = where / "__init__.py" if where.is_dir() else where.with_suffix(".py")
            if not file.is_file():
                return None
            return importlib.util.spec_from_file_location(
                name, file, submodule_search_locations=[str(where)] if where.is_dir() else None)

    sys.meta_path.insert(0, _StandIn())
    _find_spec = importlib.util.find_spec

    def _find_spec_outside_main(name, package=None):
        """A library asking whether torchvision is there (transformers' availability checks)
        is told no: only the script's own imports get the stand-in."""
        caller = sys._getframe(1).f_globals.get("__name__")
        if (name == "torchvision" or name.startswith("torchvision.")) and caller != "__main__":
            return None
        return _find_spec(name, package)

    importlib.util.find_spec = _find_spec_outside_main
