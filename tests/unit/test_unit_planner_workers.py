"""The planner's tracing workers: forked only where no CUDA device is visible (seen on an H200:
a forked trace fails once the parent has touched CUDA), else the traces run in turn, in order."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch

from shardwise.plan import planner


def _no_pool(*_: Any, **__: Any) -> Any:
    raise AssertionError("a pool of forked tracing workers was started")


@pytest.mark.parametrize("cuda", [True, False])
def test_traces_fork_only_without_cuda(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    ran: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(planner, "run_trace", lambda job: ran.append(job) or {job: job})
    if cuda:
        monkeypatch.setattr(multiprocessing, "get_context", _no_pool)
        assert planner._run_all([3, 1, 2], workers=4) == [{3: 3}, {1: 1}, {2: 2}]  # type: ignore[list-item]
        assert ran == [3, 1, 2]  # in this process, in order
    else:
        pools: list[str] = []
        real = multiprocessing.get_context
        monkeypatch.setattr(multiprocessing, "get_context", lambda m: pools.append(m) or real(m))
        assert planner._run_all([3, 1, 2], workers=2) == [{3: 3}, {1: 1}, {2: 2}]  # type: ignore[list-item]
        assert pools == ["fork"] and ran == []  # the work ran in the forked workers, not here
