"""`python -m shardwise.trainer.run SCRIPT ARGS...`: run SCRIPT as `python SCRIPT ARGS...` would,
with transformers' Trainer put on shardwise when the script imports it (`install`), and a script's
own Accelerate `Accelerator` refused in one line (it would ignore the config). `shardwise launch`
runs every worker through it."""

from __future__ import annotations

import importlib.abc
import importlib.util
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ..runtime.supervision import tell_the_launcher


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then[name](module)` once the module `name` has been executed (first import)."""

    def __init__(self, then: dict[str, Callable[[ModuleType], None]]) -> None:
        self.then = dict(then)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in self.then:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, after = spec.loader, self.then.pop(fullname)
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            after(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m shardwise.trainer.run SCRIPT [ARGS...]")
    from . import routes  # (each hook read when its module is imported)

    sys.meta_path.insert(0, AfterImport({"transformers.trainer": lambda m: routes.on_trainer_import(m),
                                         "accelerate.accelerator": lambda m: routes.on_accelerate_import(m)}))
    script = args[0]
    sys.argv = args
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as err:  # torchrun's error file, as its `@record` would write (the launcher's line)
        tell_the_launcher(err)
        raise
    routes.end_open()  # the runs a Trainer script left open (it seldom calls trainer.end())


if __name__ == "__main__":
    main()
