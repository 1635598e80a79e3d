"""`engine.lone.LoneCalls`'s decisions, in process: the rendezvous after a barrier read from an
in-memory store (what the other process posted), the commands the main process would send
collected instead of broadcast. The serving itself, across processes: tests/test_lone_calls.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.world import DistInfo
from shardwise.engine import lone
from shardwise.weights.ema import PreparedEMA


class _EMA:
    def __init__(self) -> None:
        self.shadow_params: list[torch.Tensor] = []


def _calls(monkeypatch: pytest.MonkeyPatch, rank: int, posted: str | None = None,
           word: str | None = None) -> tuple[lone.LoneCalls, list[Any], Any, nn.Module, Any]:
    """A LoneCalls at `rank` of 2 just past a barrier (armed), with the other process's post or
    the main process's word already in the store; what it sends is collected."""
    store = dist.HashStore()
    monkeypatch.setattr(lone, "default_store", lambda: store)
    model = nn.Linear(2, 2)
    ema = _EMA()
    info = DistInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=torch.device("cpu"))
    calls = lone.LoneCalls(info, 5.0, lambda: [model], lambda: [PreparedEMA(ema, list(model.parameters()))],
                           lambda m: m, lambda m: {})
    calls.barriers, calls.armed = 1, True
    sent: list[Any] = []

    def send(self: lone.LoneCalls, command: tuple[Any, ...]) -> None:
        sent.append((list(self.journal), command))
        self.journal.clear()

    monkeypatch.setattr(lone.LoneCalls, "_send", send)
    if posted is not None:
        store.set("shardwise/lone/1/1", posted)
    if word is not None:
        store.set("shardwise/lone/1", word)
    return calls, sent, store, model, ema


def test_a_lone_forward_while_the_other_trains_is_served_with_the_ema_calls_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls, sent, store, model, ema = _calls(monkeypatch, 0, posted="a step boundary")
    calls.record(ema, "store", list(model.parameters()))
    calls.record(ema, "copy_to", list(model.parameters()))
    def command() -> tuple[Any, ...]:
        return calls.forward_command(model, (torch.ones(1, 2),), {"scale": 2})

    assert calls.maybe_alone("a no-grad forward of model 0", command) is True
    assert store.get("shardwise/lone/1") == b"serve" and calls.serving
    (journal, first), = sent
    assert journal == [(0, "store", 0), (0, "copy_to", 0)] and first[:2] == ("forward", 0)
    assert calls.maybe_alone("a no-grad forward of model 0", command) is True  # served, no new word
    calls.record(ema, "restore", list(model.parameters()))
    calls.common("a DataLoader pass")  # a call the other process makes: "done", with the restore
    assert sent[-1] == ([(0, "restore", 0)], ("done",)) and not calls.serving and not calls.armed
    assert len(sent) == 3


def test_the_same_call_on_every_process_is_together_and_nothing_is_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls, sent, store, model, ema = _calls(monkeypatch, 0, posted="a no-grad forward of model 0")
    calls.record(ema, "copy_to", list(model.parameters()))
    never = lambda: pytest.fail("the command was made")  # noqa: E731
    assert calls.maybe_alone("a no-grad forward of model 0", never) is True
    assert store.get("shardwise/lone/1") == b"together" and not calls.serving and calls.journal == []
    assert sent == []
    assert calls.maybe_alone("a no-grad forward of model 0", never) is False  # no rendezvous left


def test_a_common_call_first_says_together_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, sent, store, _, _ = _calls(monkeypatch, 0)  # the other process has posted nothing yet
    calls.common("a step boundary")
    assert store.get("shardwise/lone/1") == b"together" and sent == [] and not calls.armed


def test_the_other_process_posts_its_call_and_goes_on_when_told_together(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls, _, store, _, _ = _calls(monkeypatch, 1, word="together")
    monkeypatch.setattr(lone.LoneCalls, "_serve", lambda self: pytest.fail("served on 'together'"))
    calls.common("end_training")
    assert store.get("shardwise/lone/1/1") == b"end_training" and not calls.armed


def test_the_other_process_serves_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, _, _, _, _ = _calls(monkeypatch, 1, word="serve")
    served: list[bool] = []
    monkeypatch.setattr(lone.LoneCalls, "_serve", lambda self: served.append(True))
    calls.common("a step boundary")
    assert served == [True]


def test_no_word_within_the_timeout_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, _, _, _, _ = _calls(monkeypatch, 1)
    calls.wait_s = 0.05
    with pytest.raises(RuntimeError, match=r"^end_training: waited 0 s after wait_for_everyone\(\)"):
        calls.common("end_training")


def test_the_ema_calls_are_kept_only_on_the_main_process_between_a_barrier_and_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    other, _, _, model, ema = _calls(monkeypatch, 1)
    other.record(ema, "copy_to", list(model.parameters()))
    assert other.journal == []
    main, _, _, model, ema = _calls(monkeypatch, 0)
    main.record(_EMA(), "copy_to", list(model.parameters()))  # an EMA of no prepared model
    main.record(ema, "copy_to", [torch.zeros(2)])  # parameters of no prepared model
    assert main.journal == []
    main.armed = False
    main.record(ema, "copy_to", list(model.parameters()))  # no rendezvous pending
    assert main.journal == []


def test_inputs_travel_as_cpu_tensors_with_everything_else_as_it_is() -> None:
    data = ({"x": torch.ones(2), "n": 3}, [torch.zeros(1), None], "text")
    moved = lone._moved(data, lambda t: t + 1)
    assert moved[0]["n"] == 3 and moved[1][1] is None and moved[2] == "text"
    assert torch.equal(moved[0]["x"], torch.full((2,), 2.0)) and torch.equal(moved[1][0], torch.ones(1))
