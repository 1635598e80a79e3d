"""Models out, adapter-aware: `Engine.save_model` of a peft model writes its adapter (or, asked,
the merged full model); a sharded model's own `save_pretrained`, called on every process as
transformers' scripts do, gathers the weights and the main process writes them (`_save_whole`;
on one process alone it is refused in one line).

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
the weights on the main process), then written as a plain model folder (`weights.export`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..distributed.internals import is_sharded, shard_like
from .export import save_model_files
from .storage import CheckpointError, fsync_path, new_staging, os_error_line

_REFUSED = "_shardwise_refuses_save"  # marks a save_pretrained this module put on an instance


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


# -- save_pretrained of a sharded model ---------------------------------------------------------
_SOURCE = "_shardwise_full_weights"  # on a prepared model (and a peft model's base): its FullWeights


@dataclass(slots=True)
class FullWeights:
    """Where a sharded model's own `save_pretrained` gets the whole weights: the engine that
    prepared it sets one on the model (`attach_full_weights`)."""

    gather: Callable[[], dict[str, torch.Tensor]]
    """every process: the full weights on the main process, {} on the others (a collective)"""
    together: Callable[[], bool]
    """every process makes this call (an arrival check through the store, no collective)"""
    noun: str
    """what the user calls the object that prepared the model ("engine" or "accelerator")"""
    rank: int
    held: dict[str, torch.Tensor] | None = None
    """gathered already, on every process at once (the save hooks'): used without a collective"""


def attach_full_weights(module: nn.Module, source: FullWeights) -> None:
    """`module.save_pretrained(...)` (and a peft model's base's) gets its weights from `source`."""
    module.__dict__[_SOURCE] = source
    get_base = getattr(module, "get_base_model", None)
    if is_peft_model(module) and callable(get_base):
        base = get_base()
        prefix = "base_model.model."  # peft's names for the base model's tensors
        base.__dict__[_SOURCE] = FullWeights(
            lambda: {k.removeprefix(prefix): v for k, v in source.gather().items()},
            source.together, source.noun, source.rank)


@contextlib.contextmanager
def full_weights_held(modules: list[nn.Module]) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Each module's weights (a list, in order): a sharded one's gathered here, on every process
    (a collective: the main process gets the whole, the others {}), and inside, that module's own
    `save_pretrained` writes them without gathering again, on the main process alone too, as
    save hooks do (`if accelerator.is_main_process: model.save_pretrained(...)`)."""
    weights: list[dict[str, torch.Tensor]] = []
    held: list[FullWeights] = []
    for m in modules:
        source: FullWeights | None = getattr(m, _SOURCE, None)
        if source is not None and _holds_a_shard(m):
            source.held = source.gather()
            held.append(source)
            weights.append(source.held)
        else:
            weights.append(m.state_dict())
    try:
        yield weights
    finally:
        for source in held:
            source.held = None


def _holds_a_shard(module: nn.Module) -> bool:
    """Whether some parameter of `module` is held in part by this process (an FSDP2 DTensor, or
    a DeepSpeed ZeRO-3 partition): a save from this process alone would miss the rest."""
    return any(is_sharded(p) or hasattr(p, "ds_shape") for p in module.parameters())


def _refusal(module: nn.Module, noun: str, rank: int | None) -> str:
    where = "" if rank is None else f"on process {rank} alone (e.g. under `if {noun}.is_main_process:`), but "
    return (
        f"{type(module).__name__}.save_pretrained was called {where}the model is sharded across processes "
        f"and this process holds only its shard: call it on every process (the weights are gathered and the "
        f"main process writes them), or call {noun}.save_model(model, dir) on every process (a peft model "
        f"is saved as its adapter), or pass state_dict={noun}.get_state_dict(model) gathered on every process"
    )


def _save_whole(module: nn.Module, save: Any, *args: Any, **kwargs: Any) -> Any:
    """A sharded model's `save_pretrained`, called on every process: the weights are gathered
    once and the main process writes them with the library's own `save_pretrained` (tied
    weights share one tensor, so transformers writes them once). Called on one process alone
    it is refused in one line; with a `state_dict` given, or unsharded, it is the library's."""
    if kwargs.get("state_dict") is not None or not _holds_a_shard(module):
        return save(*args, **kwargs)
    source: FullWeights | None = getattr(module, _SOURCE, None)
    if source is None:
        raise RuntimeError(_refusal(module, "engine", None))
    state = source.held
    if state is None:
        if not source.together():
            raise RuntimeError(_refusal(module, source.noun, source.rank))
        state = source.gather()
    if source.rank != 0:
        return None  # it gathered with the main process, which writes
    if "state_dict" in inspect.signature(save).parameters:  # transformers
        return save(*args, **{**kwargs, "state_dict": state})
    # a save_pretrained that reads `self.state_dict()` itself (diffusers' ModelMixin, peft's)
    module.__dict__["state_dict"] = lambda *_, **__: state
    try:
        return save(*args, **kwargs)
    finally:
        del module.__dict__["state_dict"]


def unwrapped(module: nn.Module) -> nn.Module:
    """`module` made safe to use alone (`Engine.unwrap_model`, and already at `prepare` by the
    FSDP2 and DeepSpeed strategies, so the prepared model is safe too): `_guard_save`. Returns
    `module`. (A sharded model's `generate`, a peft model's too, runs as a forward of the root:
    `strategies.direct_calls`.)"""
    _guard_save(module)
    return module


def _guard_save(module: nn.Module) -> None:
    """Give `module` (and a peft model's base model) the `save_pretrained` of `_save_whole`
    (transformers would crash on a DTensor's storage, and DeepSpeed's ZeRO-3 partitions would be
    written as empty (0,)-shaped tensors) and the `load_state_dict` of `_load_whole`."""
    targets = [module]
    get_base = getattr(module, "get_base_model", None)
    if is_peft_model(module) and callable(get_base):
        targets.append(get_base())
    for target in targets:
        for name, replacement in (("save_pretrained", _save_whole), ("load_state_dict", _load_whole)):
            original = getattr(target, name, None)
            if callable(original) and not getattr(original, _REFUSED, False):
                guarded = functools.partial(replacement, target, original)
                setattr(guarded, _REFUSED, True)
                target.__dict__[name] = guarded  # the instance only; the class stays as it is


def _load_whole(module: nn.Module, load: Any, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
    """A sharded (FSDP2) model's `load_state_dict`, given whole tensors (a load hook that read a
    saved folder, as diffusers' does): each is cut to its tensor's layout first, on each process
    from its own copy (every process passes the same whole values), then loaded as torch does."""
    current = module.state_dict(keep_vars=True)
    cut = {}
    for key, value in state_dict.items():
        mine = current.get(key)
        if (isinstance(mine, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                and tuple(value.shape) == tuple(mine.shape)):
            value = shard_like(value, mine, dtype=mine.dtype)
        cut[key] = value
    return load(cut, *args, **kwargs)
