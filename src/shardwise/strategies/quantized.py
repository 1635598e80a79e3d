"""Quantized weights under sharding: what this version refuses.

A bitsandbytes 4-bit weight (`Params4bit`: packed 4-bit values in a byte or bf16 storage, its
scales in a `quant_state` beside it) cannot be sharded as a plain tensor: FSDP2 and DeepSpeed
ZeRO-3 cut and gather the packed storage but not its `quant_state`, so each process
dequantizes with scales that do not belong to what it gathered. Measured: the first step's loss
is one process's, every later one drifts (a tiny Llama with LoRA on q/v: 4.1640 against 4.1739
at the second step; adapters 5e-2 off after a few). Replicated (ddp, zero1, DeepSpeed's ZeRO-1
and ZeRO-2, which shard the optimizer and the gradients of the adapters only) it is exact, and
is kept so. Sharding a 4-bit base is the QLoRA work still to come.
"""

from __future__ import annotations

from torch import nn

from ..config.tree import ConfigError


def quantized_weights(model: nn.Module) -> list[str]:
    """The names of `model`'s bitsandbytes 4-bit parameters (a `quant_state` beside the data)."""
    return [name for name, p in model.named_parameters()
            if type(p).__name__ == "Params4bit" or getattr(p, "quant_state", None) is not None]


def refuse_sharded_quantized(model: nn.Module, strategy: str) -> None:
    """One line, before anything is sharded, where `strategy` would shard a 4-bit weight."""
    names = quantized_weights(model)
    if names:
        raise ConfigError(f"strategy {strategy}: {type(model).__name__} holds {len(names)} bitsandbytes "
                          f"4-bit weight(s) ({names[0]}, ...), which this version cannot shard exactly "
                          "(their scales are not cut with them); use strategy zero1 or ddp (the 4-bit base "
                          "replicated, the adapters' optimizer state sharded by zero1)")
