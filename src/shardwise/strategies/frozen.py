"""Models prepared for inference only: a frozen reference or teacher beside the trained policy.

A model with no trainable parameter (all frozen), or one `Accelerator.prepare_model(...,
evaluation_mode=True)` marks, is prepared without anything training needs:
  zero3              sharded like a trained model (FSDP2 units per block, dim-0 shards at rest,
                     each block all-gathered for its forward and freed right after it), so a rank
                     holds 1/W of its parameters. Nothing requires a gradient, so no gradient is
                     made and nothing is reduce-scattered; no optimizer holds it, so it has no
                     optimizer state.
  ddp, zero1, zero2  replicated: a whole copy on every rank, no DDP wrapper (nothing to reduce).
                     These strategies keep whole parameters anyway; sharding the copy would add
                     an all-gather to each of its forwards to save memory they do not ask to save.
backend="deepspeed" lays such a model out the same way with our own FSDP2 (zero3) or as a
replica (zero1, zero2): DeepSpeed's engine is built around an optimizer step and refuses a
model without trainable parameters, while the trained models beside it stay DeepSpeed's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

_INFERENCE = "_shardwise_inference"  # set on a model `evaluation_mode=True` prepares


def mark_for_inference(model: nn.Module) -> None:
    """Prepare `model` for inference only even if some of its parameters require gradients
    (Accelerate's `evaluation_mode=True`): no DDP wrapper, no optimizer may hold it."""
    object.__setattr__(model, _INFERENCE, True)


def for_inference(model: nn.Module) -> bool:
    """`model` is prepared for inference only: marked, or nothing in it can train."""
    return bool(getattr(model, _INFERENCE, False)) or not any(p.requires_grad for p in model.parameters())


def check_inference_models(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Refuse an optimizer over a model prepared for inference (before anything is prepared):
    such a model gets no gradient synchronisation, so training it would diverge per rank."""
    for model in models:
        if not for_inference(model):
            continue
        ids = {id(p) for p in model.parameters()}
        for optimizer in optimizers:
            held = sum(id(p) in ids for g in optimizer.param_groups for p in g["params"])
            if not held:
                continue
            marked = bool(getattr(model, _INFERENCE, False))
            why, fix = (("is prepared with evaluation_mode=True",
                         "prepare it without evaluation_mode to train it")
                        if marked else ("has no trainable parameters (all frozen)",
                                        "unfreeze what should train (requires_grad_(True)) before prepare"))
            raise ValueError(
                f"{type(optimizer).__name__} holds {held} parameter(s) of {type(model).__name__}, "
                f"which {why} "
                f"and is prepared for inference only: {fix}, or leave the model out of the optimizer"
            )
