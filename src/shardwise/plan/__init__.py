"""Plan before you run: which strategy and per-device batch fit, predicted from real traces.

    from shardwise.plan import PlanRequest, plan_module, plan_named
    plan = plan_named("gpt2-xl", PlanRequest(world_size=1, device_memory="24GB"), seq_len=128)
    plan.best, plan.best.why, plan.find("zero3", "params").max_batch

The model is traced on fake tensors through the real strategies (nothing is allocated, no device
is needed); see `trace.py` for what is measured, `fit.py` for how traces become predictions.
"""

from .fit import Hardware, Overheads
from .planner import (
    CANDIDATES,
    GlobalBatch,
    Plan,
    PlanRequest,
    StrategyPlan,
    parse_memory,
    plan_model,
    plan_module,
    plan_named,
)
from .presets import PRESETS, ModelSpec, PlanError, resolve_model
from .trace import Candidate

__all__ = [
    "CANDIDATES",
    "PRESETS",
    "Candidate",
    "GlobalBatch",
    "Hardware",
    "ModelSpec",
    "Overheads",
    "Plan",
    "PlanError",
    "PlanRequest",
    "StrategyPlan",
    "parse_memory",
    "plan_model",
    "plan_module",
    "plan_named",
    "resolve_model",
]
