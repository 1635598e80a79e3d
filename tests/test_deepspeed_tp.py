"""Tensor parallelism on the DeepSpeed backend: its AutoTP (`tensor_parallel.autotp_size`), with
ZeRO-1, ZeRO-2 and ZeRO-2 with optimizer offload, against one plain process (fp32).

A tiny transformers Llama (4 heads, 2 key/value heads) trained under `tensor_parallel_size: 2`:
  2 processes   tp 2 (one data-parallel rank): losses and clipped gradient norms within 1e-5,
                final weights within 1e-5 of one process on the same batches; each rank holds
                AutoTP's share (q/k/v/o, gate/up/down and the head halved, the rest whole); the
                checkpoint loads under the torch backend's zero3 without tp bit-identical, and a
                torch zero3 checkpoint loads back into AutoTP's parts bit-identical; `save_model`
                writes what transformers' `from_pretrained` loads in a plain process;
  4 processes   dp 2 x tp 2 with zero2: the same checks against one process with the global batch.
ZeRO-3 with AutoTP is refused at config time (tests/unit/test_unit_tensor_parallel.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import workloads as W
from planted import caught, planted
from spawn import spawn
from test_tensor_parallel import STEPS, Moved, TPRun, _planned, _prepared, _reference, _train, tp_share

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed not installed (pip install 'shardwise[deepspeed]'); CI installs it",
)

CASES = {"zero1": ("zero1", "none"), "zero2": ("zero2", "none"), "zero2 offload": ("zero2", "optimizer")}


def _two(folder: str) -> dict[str, Any]:
    """TPRun by case; "into_zero3", "into_autotp": Moved."""
    import shardwise

    out: dict[str, Any] = {}
    for case, (strategy, offload) in CASES.items():
        engine = shardwise.Engine(backend="deepspeed", strategy=strategy, offload=offload, cpu=True,
                                  seed=W.SEED, tensor_parallel_size=2,
                                  checkpoint_dir=f"{folder}/{case.replace(' ', '_')}")
        run = _train(engine, dp=1)
        if case == "zero2":
            engine.save_state()
            engine.save_model(run.model, f"{folder}/export")
        out[case] = run.sent()
        engine.free_memory()
    # AutoTP's checkpoint into the torch backend's zero3 without tp; that one back into AutoTP
    plain = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, checkpoint_dir=f"{folder}/zero2")
    model, _opt, _loader = _prepared(plain, dp=2)
    out["into_zero3"] = Moved(plain.load_state(), plain.get_state_dict(model))
    plain.save_state(f"{folder}/from_zero3")
    plain.free_memory()
    back = shardwise.Engine(backend="deepspeed", strategy="zero2", cpu=True, seed=W.SEED,
                            tensor_parallel_size=2)
    model, _opt, _loader = _prepared(back, dp=1)
    step = back.load_state(f"{folder}/from_zero3")
    out["into_autotp"] = Moved(step, back.get_state_dict(model))
    return out


def _four() -> TPRun:
    import shardwise

    engine = shardwise.Engine(backend="deepspeed", strategy="zero2", cpu=True, seed=W.SEED,
                              tensor_parallel_size=2)
    return _train(engine, dp=2).sent()


def _autotp_share() -> int:
    """Parameters on one rank under AutoTP at tp 2: every Linear split (the attention and MLP
    projections and the head), embeddings and norms whole."""
    return tp_share("llama", lambda n: _planned(n) or n.startswith("lm_head"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("autotp")


@pytest.fixture(scope="module")
def two(folder: Path) -> list[dict[str, Any]]:  # (see _two)
    return spawn(_two, 2, str(folder))


@pytest.mark.parametrize("case", list(CASES))
def test_autotp_matches_one_process(two: list[dict[str, Any]], case: str) -> None:
    check_autotp_matches(two, case)


def _zero2_alone() -> dict[str, Any]:
    import shardwise

    engine = shardwise.Engine(backend="deepspeed", strategy="zero2", cpu=True, seed=W.SEED,
                              tensor_parallel_size=2)
    return {"zero2": _train(engine, dp=1).sent()}


def test_planted_autotp_row_split_unread_is_caught() -> None:
    """`autotp_row_split_unread`: the input-split layers' parts taken for whole weights; the
    gathered weights no longer match one process's (the tp 2 zero2 case alone)."""
    caught(check_autotp_matches, spawn(planted(_zero2_alone, "autotp_row_split_unread"), 2), "zero2",
           must=r"^shapes differ: \{'model\.layers\.0\.self_attn\.o_proj\.weight': "
                r"\(\(32, 16\), \(32, 32\)\)")  # the row split's part taken for the whole


def check_autotp_matches(two: list[dict[str, Any]], case: str) -> None:
    ref = _reference(dp=1)
    for rank in two:
        run = rank[case]
        assert run.batches == STEPS
        assert W.close(run.losses, ref.losses) < 1e-5
        assert W.close(run.norms, ref.norms) < 1e-5
        assert run.local == _autotp_share()
    assert W.max_diff(two[0][case].state, ref.state) < 1e-5


def test_an_autotp_checkpoint_moves_to_the_torch_backend_and_back(two: list[dict[str, Any]]) -> None:
    for rank in two:
        assert rank["into_zero3"].step == STEPS and rank["into_autotp"].step == STEPS
    trained = two[0]["zero2"].state
    assert W.max_diff(two[0]["into_zero3"].state, trained) == 0.0
    assert W.max_diff(two[0]["into_autotp"].state, trained) == 0.0


def test_the_autotp_export_loads_in_transformers(two: list[dict[str, Any]], folder: Path) -> None:
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM.from_pretrained(folder / "export")
    assert W.max_diff(dict(plain.state_dict()), two[0]["zero2"].state) == 0.0


def test_dp2_x_autotp2_matches_one_process() -> None:
    four = spawn(_four, 4)
    ref = _reference(dp=2)
    for run in four:
        assert run.batches == STEPS
        assert W.close(run.losses, ref.losses) < 1e-5
        assert W.close(run.norms, ref.norms) < 1e-5
        assert run.local == _autotp_share()  # zero2 shards the optimizer state, not the parameters
    assert W.max_diff(four[0].state, ref.state) < 1e-5
