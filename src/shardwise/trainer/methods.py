"""The Trainer's methods that shardwise replaces, each written once as `f(trainer, original, ...)`
(`original`: the implementation it replaces, bound) so the mixin (`super()`) and `install()` (the
function it patched over on `transformers.Trainer`) share them.

What changes and why:
- `create_accelerator_and_postprocess`: the Trainer's own, building `TrainerAccelerator` where it
  builds Accelerate's; then one line says what runs (strategy, where the config came from).
- checkpoints (`_save_optimizer_and_scheduler`, `_load_optimizer_and_scheduler`,
  `_load_from_checkpoint`): the Trainer's `checkpoint-N/` folder holds shardwise's sharded state in
  `checkpoint-N/shardwise/` (model, optimizer, written by every process, each its own shards;
  resumable at another number of processes or strategy) beside the Trainer's own files
  (trainer_state.json, scheduler.pt, rng_state_*.pth). No process gathers the whole model for a
  checkpoint: `save_model()` / `shardwise export` make a `from_pretrained` folder of one.
- `save_model`: a collective export (`Accelerator.save_model`: config.json and safetensors, a peft
  model's adapters as adapters), on every process, instead of `save_pretrained` on the main one
  (which would gather a sharded model alone, a hang).
- `_load_best_model`: the best checkpoint's state, loaded into the sharded model.
- `get_resumed_dataloader`: the prepared loader's own skip (Accelerate's `skip_first_batches`
  function knows only Accelerate's loaders).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..accelerate.plugins import announce
from ..config.tree import ConfigError, offload_spec
from .accelerator import TrainerAccelerator

STATE = "shardwise"  # checkpoint-N/shardwise: the sharded state
SCHEDULER = "scheduler.pt"  # the Trainer's name for its scheduler's state


def create_accelerator_and_postprocess(trainer: Any, original: Callable[[], None]) -> None:
    import transformers.trainer as module

    given = module.Accelerator  # type: ignore[attr-defined]
    module.Accelerator = TrainerAccelerator  # type: ignore[attr-defined]  # the name the Trainer builds it by
    try:
        original()
    finally:
        module.Accelerator = given  # type: ignore[attr-defined]
    acc = trainer.accelerator
    own_accumulation(acc, trainer.args)
    model_parallel(acc)
    shard = acc.config.sharding
    offload = f", offload {shard.offload}" if offload_spec(shard.offload).any else ""
    source = config_source()
    announce(acc.is_main_process,
             f"{type(trainer).__name__} runs on shardwise's Accelerator: strategy {shard.strategy}{offload}, "
             f"{shard.precision}, {shard.backend} backend, {acc.num_processes} process(es); config: {source}")


def own_accumulation(acc: TrainerAccelerator, args: Any) -> None:
    """The Trainer accumulates itself (its loss divided by its own steps or item count, its
    micro-steps set by `_set_sync_gradients`): the engine takes one micro-step per step. A config
    (or a DeepSpeed JSON, whose "auto" the Trainer filled) that says otherwise is the Trainer's
    value or refused."""
    training = acc.config.training
    steps = args.gradient_accumulation_steps
    if training.grad_accum_steps not in (1, steps):
        raise ConfigError(
            f"grad_accum_steps={training.grad_accum_steps} (from {config_source()} or a DeepSpeed JSON) and "
            f"the Trainer's gradient_accumulation_steps={steps} disagree: the Trainer accumulates, so set "
            "gradient_accumulation_steps in its TrainingArguments and drop grad_accum_steps from the config")
    if training.train_batch_size not in (None, "auto"):
        raise ConfigError(
            f"train_batch_size={training.train_batch_size} in {config_source()}: under the Trainer the "
            "batch is its per_device_train_batch_size x gradient_accumulation_steps x processes; set those "
            "in "
            "TrainingArguments and drop train_batch_size from the config")
    acc.engine.set_grad_accum(1)


def model_parallel(acc: TrainerAccelerator) -> None:
    """Tensor, context and expert parallelism under the Trainer: refused in one line, for now. The
    Trainer sizes its token count and its loss scale by its own reading of the layout
    (`get_tp_size`, `get_cp_size`) and prepares context-parallel inputs itself, each written for
    Accelerate's; under shardwise's layout the losses come out other than one process's."""
    layout = acc.config.parallelism
    named = [f"{name}={size}" for name, size in (("tensor_parallel_size", layout.tp),
                                                 ("context_parallel_size", layout.cp),
                                                 ("expert_parallel_size", layout.ep)) if size > 1]
    if named:
        raise ConfigError(
            f"{', '.join(named)} (from {config_source()}) under transformers' Trainer is not supported: the "
            "Trainer normalises its loss by its own reading of the layout, written for Accelerate's; train "
            "with data parallelism and sharding (ddp, zero1-3, offload, hybrid) here, or use the layout "
            "from your own loop (shardwise.Engine or shardwise.Accelerator)")


def config_source() -> str:
    """Where the run's settings came from, in words: the file `shardwise launch` was given (its
    resolved copy says so on its first line), a SHARDWISE_CONFIG file, or none."""
    path = os.environ.get("SHARDWISE_CONFIG")
    if not path:
        return "no file (the defaults, install()'s settings and the Trainer's arguments)"
    try:
        with open(path) as f:
            first = f.readline()
    except OSError:
        return path
    said = first.removeprefix("# resolved by shardwise launch from ").strip()
    return said if said != first.strip() else path


def _state_dir(checkpoint: str | os.PathLike[str]) -> Path:
    return Path(checkpoint) / STATE


def save_optimizer_and_scheduler(trainer: Any, original: Callable[[str], None], output_dir: str) -> None:
    trainer.accelerator.save_state(_state_dir(output_dir))
    if trainer.args.should_save and trainer.lr_scheduler is not None:
        torch.save(trainer.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER)


def load_optimizer_and_scheduler(trainer: Any, original: Callable[[str | None], None],
                                 checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    trainer.accelerator.load_state(_checked(checkpoint))
    scheduler = Path(checkpoint) / SCHEDULER
    if trainer.lr_scheduler is not None and scheduler.is_file():
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _checked(checkpoint: str | os.PathLike[str]) -> Path:
    state = _state_dir(checkpoint)
    if not state.is_dir():
        raise ConfigError(
            f"resume_from_checkpoint={str(checkpoint)!r}: no {STATE}/ folder in it, so it was not written "
            "by a Trainer on shardwise (Accelerate's and DeepSpeed's checkpoints hold their own layouts); "
            "resume from a checkpoint this run wrote, or start from the weights with from_pretrained")
    return state


def load_from_checkpoint(trainer: Any, original: Callable[..., None], resume_from_checkpoint: str,
                         model: Any = None) -> None:
    """Called before the model is prepared: the weights come back with the rest of the state once
    it is (`load_optimizer_and_scheduler`); here the folder is only checked, before any work."""
    _checked(resume_from_checkpoint)


def load_best_model(trainer: Any, original: Callable[[], None]) -> None:
    trainer.accelerator.load_state(_checked(trainer.state.best_model_checkpoint))


def save_model(trainer: Any, original: Callable[..., None], output_dir: str | None = None,
               _internal_call: bool = False) -> None:
    if _internal_call:  # a checkpoint: its model is in the sharded state (save_optimizer_and_scheduler)
        return
    target = output_dir if output_dir is not None else trainer.args.output_dir
    trainer.accelerator.save_model(trainer.model, target)
    if trainer.args.should_save:
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(target)
        torch.save(trainer.args, Path(target) / "training_args.bin")
    if trainer.args.push_to_hub:
        trainer.push_to_hub(commit_message="Model save", revision=trainer.args.hub_revision)


def get_resumed_dataloader(trainer: Any, original: Callable[..., Any], dataloader: Any,
                           num_batches: int) -> Any:
    return trainer.accelerator.skip_first_batches(dataloader, num_batches)


REPLACED: dict[str, Callable[..., Any]] = {
    "create_accelerator_and_postprocess": create_accelerator_and_postprocess,
    "_save_optimizer_and_scheduler": save_optimizer_and_scheduler,
    "_load_optimizer_and_scheduler": load_optimizer_and_scheduler,
    "_load_from_checkpoint": load_from_checkpoint,
    "_load_best_model": load_best_model,
    "save_model": save_model,
    "get_resumed_dataloader": get_resumed_dataloader,
}
