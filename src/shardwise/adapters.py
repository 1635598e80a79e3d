"""Models out, adapter-aware: `Engine.save_model` of a peft model writes its adapter (or, asked,
the merged full model); the main-process `save_pretrained` of a sharded model is refused, and a
peft model's `generate` works under FSDP2 (`unwrapped`).

Both writers take the full state dict that every process joined to gather (`get_state_dict`);
only the main process writes. Nothing here imports peft: a module is a peft model only when peft
is already imported (a `PeftModel` cannot exist otherwise), so shardwise imports and runs without
the `shardwise[peft]` extra.

Adapter folder: peft's own format, written by peft's own `PeftModel.save_pretrained` given the
gathered state dict (it keeps only the adapter's tensors, renames them as `from_pretrained`
expects, and writes adapter_config.json beside adapter_model.safetensors; other adapters than
"default" go in sub-folders, as peft puts them). It writes into a staging folder beside the
target; the files are renamed in, the weights last, and peft's model card is left out, so a
README or anything else already in the folder stays.

Merged export: the adapter folded into the base weights by peft's own `merge_and_unload`, on a
copy of the model built on the meta device and given the gathered tensors (no second copy of
the weights on the main process), then written as a plain model folder (`consolidate`).
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .consolidate import save_model_files
from .internals import is_sharded
from .storage import CheckpointError, fsync_path, new_staging, os_error_line

_REFUSED = "_shardwise_refuses_save"  # marks a save_pretrained this module put on an instance
_ROUTED = "_shardwise_routes_generate"  # marks a peft model whose generate runs FSDP2's root hooks


def is_peft_model(module: nn.Module) -> bool:
    """Whether `module` is a peft `PeftModel` (False whenever peft was never imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def save_weights(
    module: nn.Module, state: dict[str, torch.Tensor], target: Path, *,
    max_shard_size: int | str = "5GB", merge_adapters: bool = False,
) -> None:
    """Write `state` (the gathered weights of `module`) into the folder `target`: an adapter
    folder for a peft model, its merged full model with `merge_adapters`, else the model files."""
    if is_peft_model(module):
        if not merge_adapters:
            _save_adapter(module, state, target)
            return
        module, state = _merged(module, state)
    save_model_files(module, state, target, max_shard_size=max_shard_size)


def save_problem(module: Any, target: Path, merge_adapters: bool, main: bool) -> str | None:
    """Why `save_weights` would refuse (one line), checked before the weights are gathered."""
    if main and os.path.lexists(target) and not target.is_dir():
        return f"{target}: is a file, not a folder; save_model writes a folder of files: choose another path"
    if not merge_adapters:
        return None
    if not is_peft_model(module):
        return (
            f"save_model(merge_adapters=True): {type(module).__name__} is not a peft model; "
            "drop merge_adapters"
        )
    names = list(module.peft_config)
    if len(names) != 1:
        return (
            f"save_model(merge_adapters=True): the model has {len(names)} adapters ({names}); merging "
            "folds exactly one into the base weights: delete the others first (delete_adapter), or save "
            "the adapters"
        )
    return None


def _save_adapter(module: Any, state: dict[str, torch.Tensor], target: Path) -> None:
    stage: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        stage = new_staging(target)
        # the class's method: the instance's own may be the refusal installed by _guard_save
        type(module).save_pretrained(module, str(stage), state_dict=state)
        files = [p for p in stage.rglob("*") if p.is_file() and p.name.endswith((".json", ".safetensors"))]
        target.mkdir(exist_ok=True)
        for path in sorted(files, key=lambda p: (p.suffix == ".safetensors", str(p))):  # weights last
            dest = target / path.relative_to(stage)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
        fsync_path(target)
        shutil.rmtree(stage)
    except BaseException as err:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if isinstance(err, OSError):
            raise CheckpointError(os_error_line(target, "write the adapter files", err)) from None
        raise


def _merged(module: Any, state: dict[str, torch.Tensor]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """(the base model with the adapter merged in, its state dict), built on the main process."""
    import peft

    (name,) = module.peft_config  # one adapter: save_problem refused the others
    base = module.get_base_model()
    with torch.device("meta"):  # no storage: the gathered tensors become the weights below
        fresh = peft.get_peft_model(type(base)(copy.deepcopy(base.config)),
                                    copy.deepcopy(module.peft_config[name]), adapter_name=name)
    fresh.load_state_dict(state, strict=True, assign=True)
    merged: nn.Module = fresh.merge_and_unload()
    return merged, {k: v for k, v in merged.state_dict().items() if not v.is_meta}


# -- the main-process save_pretrained ----------------------------------------------------------
def _holds_a_shard(module: nn.Module) -> bool:
    """Whether some parameter of `module` is held in part by this process (an FSDP2 DTensor, or
    a DeepSpeed ZeRO-3 partition): a save from this process alone would miss the rest."""
    return any(is_sharded(p) or hasattr(p, "ds_shape") for p in module.parameters())


def _refuse_save(module: nn.Module, save: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("state_dict") is None and _holds_a_shard(module):
        raise RuntimeError(
            f"{type(module).__name__}.save_pretrained: the model is sharded across processes and this "
            "process holds only its shard; call engine.save_model(model, dir) on every process instead (it "
            "gathers the weights; a peft model is saved as its adapter), or pass "
            "state_dict=engine.get_state_dict(model)"
        )
    return save(*args, **kwargs)


def unwrapped(module: nn.Module) -> nn.Module:
    """`module` made safe to use alone (`Engine.unwrap_model`, and already at `prepare` by the
    FSDP2 and DeepSpeed strategies, so the prepared model is safe too): `_guard_save`, and a
    peft model's `generate` run as an FSDP2 forward (`_route_generate`). Returns `module`."""
    _guard_save(module)
    if is_peft_model(module) and not getattr(module, _ROUTED, False):
        _route_generate(module)
    return module


def _route_generate(module: nn.Module) -> None:
    """peft's `generate` calls the wrapped transformers model's forward, not its own: FSDP2's
    root hooks (on the PeftModel) would not run, and the parameters they gather (embeddings,
    final norm) would stay sharded DTensors mid-forward. Registered as a forward method, the
    root gathers them for the whole generation; the blocks gather per forward as in training.
    A no-op unless `module` is an FSDP2 module (DeepSpeed hooks every submodule itself)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(module, "generate")
    module.__dict__[_ROUTED] = True


def _guard_save(module: nn.Module) -> None:
    """Give `module` (and a peft model's base model) a `save_pretrained` that refuses, in one
    line pointing to `save_model`, while the parameters are sharded and no full `state_dict` is
    passed: transformers would crash on a DTensor's storage, and DeepSpeed's ZeRO-3 partitions
    would be written as empty (0,)-shaped tensors."""
    targets = [module]
    get_base = getattr(module, "get_base_model", None)
    if is_peft_model(module) and callable(get_base):
        targets.append(get_base())
    for target in targets:
        save = getattr(target, "save_pretrained", None)
        if callable(save) and not getattr(save, _REFUSED, False):
            guarded = functools.partial(_refuse_save, target, save)
            setattr(guarded, _REFUSED, True)
            target.__dict__["save_pretrained"] = guarded  # the instance only; the class stays as it is
