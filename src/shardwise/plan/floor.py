"""What a candidate holds at its optimizer step whatever the batch: a floor that needs no trace.

At the optimizer step every rank holds its parameters, the gradients the optimizer reads and the
optimizer's state, at once (the step reads all three); activations are gone by then, so the floor
is the same for every batch and every activation-checkpointing mode. Where that floor (with the
planner's overheads) is already more than the device holds, the candidate fits no batch and is not
traced: `plan_model` reports it from the floor alone, marked as a lower bound.

Each part is a lower bound of what the trace would count on the device:
  - parameters: stage 2 and 3 keep them sharded at rest (FSDP2: 1/world of every tensor, padded
    up), the others whole; under tensor parallelism whole means at least 1/tp of them;
  - gradients: of the trainable parameters, sharded from stage 2, whole below;
  - optimizer: AdamW's two moments per trainable parameter (only for the default optimizer: a
    user's own is left out, 0), sharded from stage 1;
  - on a CUDA target, optimizer offload keeps the optimizer on the host, and parameter offload
    the parameters and gradients too; on a CPU target all of it is the one memory.
Weights, gradients and optimizer state keep the dtype the model was built in, in every precision
(`strategies.precision`: only compute runs in low precision).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .candidate import Candidate


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """The model's parameter bytes at its full depth (tied parameters once)."""

    parameters: float
    trainable: float

    @staticmethod
    def of(model: nn.Module) -> ModelBytes:
        params = list({id(p): p for p in model.parameters()}.values())
        size = [float(p.numel() * p.element_size()) for p in params]
        return ModelBytes(sum(size), sum(s for s, p in zip(size, params) if p.requires_grad))


def state_floor(cand: Candidate, model: ModelBytes, *, world_size: int, device: str,
                adam: bool) -> dict[str, float]:
    """Bytes per rank that `cand` certainly holds on the device at its optimizer step, by role
    (the breakdown names of `StrategyPlan`). `adam`: the traced optimizer is the default AdamW."""
    spec, off = cand.strategy_spec, cand.offload_spec
    whole = float(cand.tensor_parallel_size)  # replicated over data-parallel ranks: 1/tp at least
    share = float(world_size)  # sharded: 1/world at least (hybrid groups and padding hold more)
    on_cuda = device == "cuda"
    params_away = on_cuda and off.params_on_host
    optim_away = on_cuda and (off.optimizer_on_host or off.params_on_host)
    return {
        "params": 0.0 if params_away else model.parameters / (share if spec.shards_grads else whole),
        "grads": 0.0 if params_away else model.trainable / (share if spec.shards_grads else whole),
        "optimizer": 0.0 if optim_away or not adam else 2 * model.trainable / (
            share if spec.shards_optimizer else whole),
    }
