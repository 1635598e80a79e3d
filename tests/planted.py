"""Planted faults: the tests of the tests.

Every promise in docs/guarantees.md keeps a test, and a test is only worth its row if it fails
when the promise breaks. Each fault here is a monkeypatch of shardwise that breaks one promise
(sequence parallelism switched off, zero1 keeping the whole optimizer state, a gather that puts
shards back in the wrong order, a run that hangs in `end_training`, ...). A guarantee's test
runs its own worker with the fault planted and asserts that its own check fails
(`caught(check, ...)`): the check is the same function the real test calls.

Nothing in `src/` knows about this: a fault is applied from the test side only, in the worker
before it runs, by one of two routes:

- `spawn(planted(worker, "name"), world, ...)`: spawned workers (tests/spawn.py) plant it
  themselves before calling the worker;
- `env = fault_env("name")`: a launched script (torchrun, `shardwise launch`, an Accelerate
  script) gets `SHARDWISE_PLANTED_FAULT` and a PYTHONPATH whose `sitecustomize` (tests/planted_site)
  plants it at interpreter start-up, in the launcher and in every worker.

Register a fault with `@fault("name", row="...", test="tests/test_x.py::test_y")`: `row` names
the guarantees.md row it breaks, `test` the planted test that shows the row's test catching it
(tests/unit/test_unit_planted.py checks that each named test exists and plants its fault).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FAULT_ENV = "SHARDWISE_PLANTED_FAULT"  # (not SHARDWISE_TEST_FAULT: tests/scripts/resilient.py's own faults)
SITE = Path(__file__).parent / "planted_site"


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    rows: tuple[str, ...]  # the guarantees.md rows (the first cell, or a unique part) the fault breaks
    test: str  # tests/<file>.py::<test> that plants it and asserts each row's check fails
    apply: Callable[[], None]


FAULTS: dict[str, Fault] = {}


def fault(name: str, *, row: str | tuple[str, ...],
          test: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register a fault. Several rows: one regression that breaks each of their promises, their
    checks all run on the same planted workers (one spawn for the lot)."""
    def register(apply: Callable[[], None]) -> Callable[[], None]:
        assert name not in FAULTS, f"fault {name!r} registered twice"
        FAULTS[name] = Fault(name, (row,) if isinstance(row, str) else row, test, apply)
        return apply

    return register


def plant(name: str | None) -> None:
    """Apply the named fault in this process (None: nothing)."""
    if name:
        FAULTS[name].apply()


_UNDO: list[list[tuple[Any, str, Any]]] = []  # while `planted_here` runs: what each _patch replaced


@contextlib.contextmanager
def planted_here(name: str) -> Iterator[None]:
    """The named fault in this (pytest's) process for the block only, then undone: for a row
    whose check runs in process (a config refused, a file read). The fault must patch through
    `_patch`."""
    assert name in FAULTS, f"no fault named {name!r}"
    _UNDO.append([])
    try:
        plant(name)
        yield
    finally:
        for owner, attr, old in reversed(_UNDO.pop()):
            setattr(owner, attr, old)


def _run_planted(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    plant(name)
    return fn(*args)


def planted(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` for `spawn`, with the fault planted in each worker before it runs (picklable)."""
    assert name in FAULTS, f"no fault named {name!r}"
    return functools.partial(_run_planted, name, fn)


def fault_env(name: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a launched process (and everything it starts) with the fault planted."""
    assert name in FAULTS, f"no fault named {name!r}"
    env = dict(os.environ if env is None else env)
    paths = [str(SITE), str(Path(__file__).parent), env.get("PYTHONPATH", "")]
    return {**env, FAULT_ENV: name, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


# what a check's failure says when spawned workers crashed (spawn's error): never a catch. (A
# launched script's output may carry a traceback that is the finding, a refusal's or an abort's:
# `must` says which.)
CRASHED = ("worker failed:", "workers exited with [")


def caught(check: Callable[..., Any], *args: Any, must: str, **kwargs: Any) -> str:
    """Run a guarantee's check on a planted run's results; it must fail, for the right reason:
    its message must match `must` (a regular expression, searched in the whole message: what the
    fault makes the check find, a value or a field; required, and never a pattern any failure
    matches: tests/unit/test_unit_planted.py reads every call). A crash is never a catch: an
    error that is not the check's assertion propagates, and an assertion that carries spawn's
    worker error is refused. Returns the message's first line (printed, so `pytest -rA` shows
    what the check said about the fault)."""
    try:
        check(*args, **kwargs)
    except (AssertionError, pytest.fail.Exception) as err:
        whole = str(err).strip()
        message = whole.splitlines()[0] if whole else type(err).__name__
        _record(message, whole)
        if any(mark in whole for mark in CRASHED):
            raise AssertionError(f"{check.__qualname__} failed on a crash, not on the planted fault's "
                                 f"numbers: {message[:300]}") from err
        if not re.search(must, whole):
            raise AssertionError(f"{check.__qualname__} failed for another reason than the planted fault's: "
                                 f"{message[:300]!r} does not match {must!r}") from err
        print(f"planted fault caught: {message[:500]}")
        return message
    raise AssertionError(f"the planted fault went unnoticed by {check.__qualname__}")


def _record(message: str, whole: str) -> None:
    """SHARDWISE_CAUGHT_RECORD=file: each catch's test and message, one JSON line (to write `must`)."""
    path = os.environ.get("SHARDWISE_CAUGHT_RECORD")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "message": message,
                                "whole": whole[:3000]}) + "\n")


def _patch(owner: Any, name: str, replacement: Callable[..., Any]) -> None:
    """Replace `owner.name` for the rest of this (worker) process."""
    old = owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name)
    with contextlib.suppress(AttributeError):  # (a property takes no attributes)
        replacement.__wrapped__ = getattr(owner, name)  # type: ignore[attr-defined]
    if _UNDO:
        _UNDO[-1].append((owner, name, old))
    setattr(owner, name, replacement)


# -- the faults ---------------------------------------------------------------------------------
# Each one breaks exactly the promise of its row, as a plausible regression would.


@fault("hang_in_end_training", row="scripts written for Accelerate",
       test="tests/test_accelerate_scripts.py::test_a_run_that_hangs_at_the_end_fails")
def _hang_in_end_training() -> None:
    from shardwise import Engine  # the Accelerator's end_training is the engine's

    def hang(self: Any, *args: Any, **kwargs: Any) -> None:
        while True:
            time.sleep(1)

    _patch(Engine, "end_training", hang)


# -- scripts written for Accelerate, diffusers (test_accelerate_scripts / _diffusers) -------------


@fault("abort_at_teardown", row="scripts written for Accelerate",
       test="tests/test_accelerate_scripts.py::test_a_run_that_aborts_at_teardown_fails")
def _abort_at_teardown() -> None:
    """gloo's teardown abort coming back: `end_training` completes, the script writes its
    results, and the process then aborts at exit as gloo's threads did."""
    import atexit
    import sys

    from shardwise import Engine

    def end_training(self: Any, *args: Any, **kwargs: Any) -> None:
        end_training.__wrapped__(self, *args, **kwargs)  # type: ignore[attr-defined]

        def abort() -> None:
            sys.stderr.write("terminate called without an active exception\n")
            sys.stderr.flush()
            os.abort()

        atexit.register(abort)

    _patch(Engine, "end_training", end_training)


@fault("reorder_gather", row="diffusers' `train_unconditional.py` pattern",
       test="tests/test_accelerate_diffusers.py::test_a_gather_in_the_wrong_order_is_caught")
def _reorder_gather() -> None:
    """zero3's gather of full weights (save_pretrained, get_state_dict, the save hooks' weights)
    puts the processes' dim-0 shards back in reverse order: every sum is unchanged."""
    import torch
    import torch.distributed as dist

    from shardwise.strategies.fsdp import FSDPStrategy

    def full_state_dict(self: Any, model: Any) -> dict[str, Any]:
        state = full_state_dict.__wrapped__(self, model)  # type: ignore[attr-defined]
        world = dist.get_world_size()
        return {k: torch.cat(v.chunk(world)[::-1]) if v.dim() and v.shape[0] >= world else v
                for k, v in state.items()}

    _patch(FSDPStrategy, "full_state_dict", full_state_dict)


# -- tensor/sequence-parallel refusals, two nodes (test_tp_refusals, test_multinode) -------------
@fault("no_plan_not_refused", row="tensor parallelism (`tests/test_tensor_parallel.py`",
       test="tests/test_tp_refusals.py::test_planted_no_plan_not_refused_is_caught")
def _no_plan_not_refused() -> None:
    """A model without a tensor-parallel plan is left unsplit instead of refused: the run goes on
    as plain data parallelism while the user asked for tp."""
    from shardwise.strategies import steps  # the tensor-parallel step

    def apply_tensor_parallel(model: Any, plan: dict[str, str], *args: Any, **kwargs: Any) -> dict[str, str]:
        if not plan:
            return {}
        return apply_tensor_parallel.__wrapped__(model, plan, *args, **kwargs)  # type: ignore[attr-defined,no-any-return]

    _patch(steps, "apply_tensor_parallel", apply_tensor_parallel)


@fault("refusal_two_lines", row="sequence parallelism (`tests/test_sequence_parallel.py`",
       test="tests/test_tp_refusals.py::test_planted_refusal_two_lines_is_caught")
def _refusal_two_lines() -> None:
    """Sequence parallelism's refusal of a model it cannot cut gains a hint on a second line."""
    from shardwise.config.tree import ConfigError
    from shardwise.strategies import tensor_parallel

    def sequence_layout(*args: Any, **kwargs: Any) -> Any:
        try:
            return sequence_layout.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]
        except ConfigError as err:
            raise ConfigError(f"{err}\n  see docs/strategies.md (sequence parallelism)") from None

    _patch(tensor_parallel, "_sequence_layout", sequence_layout)


@fault("sequence_trial_skipped", row="sequence parallelism",
       test="tests/test_tp_refusals.py::test_planted_sequence_trial_skipped_is_caught")
def _sequence_trial_skipped() -> None:
    """prepare(model, loader) skips the meta-device trial forward: a planned MLP that sees no
    sequence is refused only at the first forward, after the model was split."""
    from shardwise.engine import engine

    _patch(engine, "model_parallel_trial", lambda *args, **kwargs: None)


@fault("tp_batch_counts_processes", row="careless layouts under tensor parallelism",
       test="tests/test_tp_careless.py::test_planted_tp_batch_counts_processes_is_caught")
def _tp_batch_counts_processes() -> None:
    """The global batch counted per process again under tensor parallelism (the probe's finding):
    a tp group's processes, which take one batch, counted as data-parallel ranks."""
    from shardwise.config import batch

    _patch(batch, "_data_parallel", lambda cfg, world: (world, f"{world} processes"))


@fault("field_docs_dropped", row="the docs (`tests/test_docs.py`",
       test="tests/test_docs.py::test_planted_field_docs_dropped_is_caught")
def _field_docs_dropped() -> None:
    """The config page's generator loses the docstrings written under a section's fields after its
    first (a walker that stops at the first field): rows with no description."""
    from shardwise.config import docs

    def field_docs(cls: type) -> dict[str, str]:
        found = field_docs.__wrapped__(cls)  # type: ignore[attr-defined]
        return dict(list(found.items())[:1])

    _patch(docs, "field_docs", field_docs)


@fault("replay_in_default_dtype", row="the recorder's pieces in one process",
       test="tests/test_init_memory.py::test_planted_replay_in_default_dtype_is_caught")
def _replay_in_default_dtype() -> None:
    """A recipe replayed in the default dtype and cast to the parameter's: a float64 parameter's
    normal_ values are float32 draws widened, not a normal build's."""
    import dataclasses

    import torch

    from shardwise.weights.record import InitRecipe

    def replay(self: Any, into: Any = None) -> Any:
        default = dataclasses.replace(self, dtype=torch.get_default_dtype())
        return replay.__wrapped__(default).to(self.dtype)  # type: ignore[attr-defined]

    _patch(InitRecipe, "replay", replay)


@fault("worker_error_unread", row="the launcher's lines (`tests/test_launch.py`",
       test="tests/test_launch.py::test_planted_worker_error_unread_is_caught")
def _worker_error_unread() -> None:
    """The launcher no longer reads a failed worker's error file: its line loses the Python error,
    and a Python error followed by an abort gets gloo's start-up hint as if none was raised."""
    from shardwise.cli import launch

    _patch(launch, "_first_error_line", lambda error_file: "")


@fault("start_time_unread", row="two runs of 2 processes on one `checkpoint_dir` at the same time",
       test="tests/test_run_lock.py::test_planted_start_time_unread_is_caught")
def _start_time_unread() -> None:
    """The lock's check of a same-host holder cannot read its process's start time (as on a
    system whose /proc it misparses): a live run's pid is judged reused, its lock taken over."""
    from shardwise.checkpoint import runlock

    _patch(runlock, "_start_ticks", lambda pid: None)


@fault("latest_before_write", row="SIGKILL in the middle of a save",
       test="tests/test_checkpoint.py::test_planted_latest_before_write_is_caught")
def _latest_before_write() -> None:
    """`latest` pointed at a checkpoint when its save begins, not once it is in place: a process
    killed mid-save leaves `latest` naming a checkpoint that was never completed."""
    from shardwise.checkpoint import files, sharded

    def begin(parts: Any, target: Any) -> None:
        begin.__wrapped__(parts, target)  # type: ignore[attr-defined]
        if parts.rank == 0:
            files.atomic_write_text(target.parent / "latest", target.name + "\n")

    _patch(sharded, "_begin", begin)


@fault("export_in_place", row="SIGKILL in the middle of `save_model`",
       test="tests/test_data_safety.py::test_planted_export_in_place_is_caught")
def _export_in_place() -> None:
    """save_model over an earlier save writes its files straight into the user's folder, no
    staging beside it: a process killed halfway leaves a half-written model.safetensors where the
    good one was."""
    from shardwise.weights import export

    def in_place(target: Any, checkpoint: Any = None) -> Any:
        if (target / "model.safetensors").exists():
            return target
        return in_place.__wrapped__(target, checkpoint)  # type: ignore[attr-defined]

    _patch(export, "new_staging", in_place)


@fault("load_not_strict", row="7 bad sources",
       test="tests/test_big_models.py::test_planted_load_not_strict_is_caught")
def _load_not_strict() -> None:
    """Loading pretrained weights no longer strict by default: keys the files lack (or hold
    besides) are skipped with a warning, the weights left uninitialised are kept."""
    from shardwise.weights import loading

    def match_keys(*args: Any, **kwargs: Any) -> Any:
        return match_keys.__wrapped__(*args, **{**kwargs, "strict": False})  # type: ignore[attr-defined]

    _patch(loading, "match_keys", match_keys)


@fault("uninitialised_accepted", row="what init_empty cannot replay",
       test="tests/test_init_and_load.py::test_planted_uninitialised_accepted_is_caught")
def _uninitialised_accepted() -> None:
    """A parameter nothing in its constructor initializes (torch.empty) is no longer a problem of
    its recipe: init_empty's model is prepared with whatever the allocation held."""
    from shardwise.weights.record import InitRecipe

    def problem(self: Any) -> str | None:
        said = problem.__wrapped__(self)  # type: ignore[attr-defined]
        return None if said is not None and said.startswith("nothing in its constructor") else said

    _patch(InitRecipe, "problem", problem)


@fault("checkpoint_first_block_only", row="activation checkpointing (`tests/test_equivalence.py",
       test="tests/test_wrap.py::test_planted_checkpoint_first_block_only_is_caught")
def _checkpoint_first_block_only() -> None:
    """Activation checkpointing wraps the first block it is given and stops (a loop that returns
    early): the numbers are right, the other blocks keep all their activations."""
    from shardwise import strategies

    def first_only(blocks: Any, *args: Any, **kwargs: Any) -> None:
        first_only.__wrapped__(list(blocks)[:1], *args, **kwargs)  # type: ignore[attr-defined]

    _patch(strategies, "apply_activation_checkpointing", first_only)


@fault("compile_skipped", row="compiled blocks (`tests/test_compile.py`",
       test="tests/test_compile.py::test_planted_compile_skipped_is_caught")
def _compile_skipped() -> None:
    """`compile: true` taken and never applied: the blocks run eager, with eager's numbers."""
    from shardwise.strategies import steps

    _patch(steps, "apply_compile", lambda *args, **kwargs: None)


@fault("scheduler_not_restored", row="the checkpointing script",
       test="tests/test_accelerate_scripts.py::test_planted_scheduler_not_restored_is_caught")
def _scheduler_not_restored() -> None:
    """load_state brings back weights, optimizer, sampler and RNG but not the LR scheduler: a
    resumed OneCycleLR starts its schedule over."""
    from shardwise.engine.optim import PreparedScheduler

    _patch(PreparedScheduler, "load_state_dict", lambda self, state_dict: None)


@fault("loader_end_sticky", row="Accelerate's rules where a script meets them",
       test="tests/test_accelerate_scripts.py::test_planted_loader_end_sticky_is_caught")
def _loader_end_sticky() -> None:
    """A loop that ran to its end is not noted: the loader stays active at its end, so
    `gradient_state.end_of_dataloader` stays True after the loop (Accelerate's says False there)."""
    from shardwise.engine.loop_state import LoaderTracker

    _patch(LoaderTracker, "ended", lambda self, loader: None)


@fault("host_step_unfused", row="fused host step",
       test="tests/test_single_process.py::test_planted_host_step_unfused_is_caught")
def _host_step_unfused() -> None:
    """The host optimizer step no longer selects torch's fused CPU kernel: the user's class runs
    its own per-tensor loop (the same update, several times slower)."""
    from shardwise.strategies import host_step

    _patch(host_step, "fused_overrides", lambda optimizer, **kwargs: {})


@fault("tensor_checksum_unchecked", row="`shardwise export` of a corrupted checkpoint",
       test="tests/test_data_safety.py::test_planted_tensor_checksum_unchecked_is_caught")
def _tensor_checksum_unchecked() -> None:
    """Verifying an export compares the checksum a safetensors file records with itself, never
    hashing its tensors: flipped bytes in the weights pass."""
    from shardwise.weights import export

    def unchecked(path: Any) -> tuple[Any, Any]:
        recorded, _ = unchecked.__wrapped__(path)  # type: ignore[attr-defined]
        return recorded, recorded

    _patch(export, "safetensors_checksum", unchecked)


@fault("deepspeed_group_accepted", row="DeepSpeed and hybrid (`tests/test_deepspeed_hybrid.py`",
       test="tests/test_deepspeed_hybrid.py::test_planted_deepspeed_group_accepted_is_caught")
def _deepspeed_group_accepted() -> None:
    """shard_group_size below the world accepted on backend deepspeed: DeepSpeed (no MiCS since
    0.19) shards over every process, not the group asked for."""
    from shardwise.strategies.deepspeed import setup

    _patch(setup, "check_shard_group", lambda *args, **kwargs: None)


@fault("empty_buffers_replaced", row="empty init (`tests/test_big_models.py`",
       test="tests/test_big_models.py::test_an_empty_build_that_replaces_its_buffers_is_caught")
def _empty_buffers_replaced() -> None:
    """An init_empty model's allocation replaces its real buffers too (as `to_empty` does), so a
    buffer its constructor computed (rotary frequencies) is lost: here, left at zero."""
    import torch

    from shardwise.strategies import base

    def allocate(model: Any, device: Any) -> None:
        allocate.__wrapped__(model, device)  # type: ignore[attr-defined]
        with torch.no_grad():
            for b in model.buffers():
                b.zero_()

    _patch(base, "allocate", allocate)


@fault("export_clears_the_folder", row="a careless user (`tests/test_data_safety.py`",
       test="tests/test_data_safety.py::test_planted_export_clears_the_folder_is_caught")
def _export_clears_the_folder() -> None:
    """save_model treats the folder as its own: every file it does not write is removed once the
    new weights are in place (the user's tokenizer and results with them)."""
    from shardwise.weights import export

    def stale(folder: Any, writing: set[str], sharded: bool) -> list[Any]:
        found = stale.__wrapped__(folder, writing, sharded)  # type: ignore[attr-defined]
        listed = list(folder.iterdir()) if folder.is_dir() else []
        others = [p for p in listed if p.is_file() and p.name not in writing]
        return sorted(set(found) | set(others))

    _patch(export, "_stale_files", stale)


@fault("launch_drops_the_files_settings", row="`shardwise launch` from a YAML",
       test="tests/test_launch.py::test_planted_launch_drops_the_files_settings_is_caught")
def _launch_drops_the_files_settings() -> None:
    """`shardwise launch` resolves the config but hands the workers one that holds only its launch
    section: they run the defaults (ddp, no offload), with the same numbers."""
    import importlib

    from shardwise.config import EngineConfig

    main = importlib.import_module("shardwise.cli.main")  # (the package's `main` is the function)

    def write_yaml(cfg: Any, path: Any, **kwargs: Any) -> Any:
        return write_yaml.__wrapped__(EngineConfig.of(launch=cfg.launch, training=cfg.training),  # type: ignore[attr-defined]
                                      path, **kwargs)

    _patch(main, "write_yaml", write_yaml)


@fault("auto_schedule_counts_every_process", row="the two tutorial DeepSpeed JSONs",
       test="tests/test_launch.py::test_planted_auto_schedule_counts_every_process_is_caught")
def _auto_schedule_counts_every_process() -> None:
    """A schedule built from the config ("auto" total steps) counts the whole dataset's batches
    (both processes' at 2), not this process's optimizer steps."""
    from shardwise.engine import engine

    def build_scheduler(cfg: Any, optimizer: Any, steps: int | None) -> Any:
        return build_scheduler.__wrapped__(cfg, optimizer, None if steps is None else 2 * steps)  # type: ignore[attr-defined]

    _patch(engine, "build_scheduler", build_scheduler)


@fault("zip_failure_in_torchs_words", row="a full disk (`tests/test_run_lock.py`)",
       test="tests/test_run_lock.py::test_planted_zip_failure_in_torchs_words_is_caught")
def _zip_failure_in_torchs_words() -> None:
    """A write failure without an errno (torch's zip writer on a full disk) is said in torch's own
    words ("unexpected pos"), not as the full disk it is."""
    from shardwise.checkpoint import storage

    def os_error_line(path: Any, action: str, err: BaseException, needed: int | None = None) -> str:
        if not isinstance(err, OSError):
            return f"{path}: could not {action}: {err}"
        return os_error_line.__wrapped__(path, action, err, needed)  # type: ignore[attr-defined,no-any-return]

    _patch(storage, "os_error_line", os_error_line)


@fault("launcher_variables_unread", row="Accelerate's launcher (`tests/test_accelerate_plugins.py`",
       test="tests/test_accelerate_plugins.py::test_planted_launcher_variables_unread_is_caught")
def _launcher_variables_unread() -> None:
    """The variables Accelerate's launcher exports (ACCELERATE_USE_FSDP, FSDP_*, ...) are not
    read: a script started by `accelerate launch --config_file X.yaml` trains with the defaults."""
    from shardwise.accelerate import plugins

    _patch(plugins, "_launcher_plugins", lambda kwargs: [])


@fault("traces_of_one_name", row="the same patterns as a script written for Accelerate",
       test="tests/test_accelerate_extras.py::test_planted_traces_of_one_name_is_caught")
def _traces_of_one_name() -> None:
    """Every process writes its profiler trace under one name (profile_0.json): the last writer
    wins and the other process's trace is lost."""
    from shardwise.accelerate import extras

    _patch(extras, "PROFILE_PATTERN", "profile_0.json")  # type: ignore[arg-type]


@fault("total_limit_over_every_checkpoint", row="`ProjectConfiguration(automatic_checkpoint_naming=True",
       test="tests/test_run_lock.py::test_planted_total_limit_over_every_checkpoint_is_caught")
def _total_limit_over_every_checkpoint() -> None:
    """total_limit counts every `checkpoint_<i>` in the folder, an earlier run's too (Accelerate's
    rule), and drops the oldest of them."""
    from shardwise.checkpoint import naming

    def saved(self: Any, target: Any) -> list[Any]:
        self.project.iteration = naming.checkpoint_index(target) + 1
        found, limit = naming.numbered_checkpoints(self.root), self.project.total_limit
        return found[:-limit] if limit and len(found) > limit else []

    _patch(naming.NumberedFolders, "saved", saved)


@fault("split_group_unchecked", row="a model split by transformers (`tests/test_parallel_dims.py`",
       test="tests/test_parallel_dims.py::test_planted_split_group_unchecked_is_caught")
def _split_group_unchecked() -> None:
    """A model that arrives split (DTensor parameters) is kept whatever group it is split over:
    one split over other processes than the run's tp group trains on a layout the run lacks."""
    from shardwise.strategies import steps

    def split_already(model: Any, dims: Any) -> bool:
        try:
            return split_already.__wrapped__(model, dims)  # type: ignore[attr-defined,no-any-return]
        except Exception as err:
            if "arrived split over processes" in str(err):
                return True
            raise

    _patch(steps, "_split_already", split_already)


@fault("split_twice", row="a model split by transformers (`tests/test_parallel_dims.py`",
       test="tests/test_parallel_dims.py::test_planted_split_twice_is_caught")
def _split_twice() -> None:
    """A model that arrives split (transformers' tp_plan="auto") is not recognized as split: the
    run's plan splits it again."""
    from shardwise.strategies import steps

    _patch(steps, "_split_already", lambda model, dims: False)


@fault("sum_across_nodes", row="two nodes for real (`tests/test_multinode.py`)",
       test="tests/test_multinode.py::test_planted_sum_across_nodes_is_caught")
def _sum_across_nodes() -> None:
    """Hybrid sharding sums the gradients across the replicate (node) dimension instead of
    averaging: FSDP2's divide factor is the shard group's size, not the world's. Under AdamW with
    every step clipped, losses and weights stay the same; the clipped norms double."""
    from torch.distributed.fsdp import FSDPModule

    from shardwise.strategies import fsdp

    def apply_fsdp(model: Any, *, mesh: Any, **kwargs: Any) -> None:
        apply_fsdp.__wrapped__(model, mesh=mesh, **kwargs)  # type: ignore[attr-defined]
        if mesh.ndim == 2:  # (dp_replicate, dp_shard)
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_gradient_divide_factor(float(mesh.size(1)))

    _patch(fsdp, "apply_fsdp", apply_fsdp)


# -- init memory and direct calls (issue 47, items 4 and 7) --
@fault("untouched_buffer_in_init_empty", row="host memory while a model is built empty",
       test="tests/test_init_memory.py::test_an_untouched_buffer_kept_by_init_empty_is_caught")
def _untouched_buffer_in_init_empty() -> None:
    """init_empty keeps, with each meta parameter, the tensor its constructor registered (the
    constructor's `torch.empty`, never written): the model's size allocated, no page touched."""
    from shardwise.weights.record import Recorder

    def track(self: Any, param: Any, real: Any) -> None:
        track.__wrapped__(self, param, real)  # type: ignore[attr-defined]
        param._planted_kept = real

    _patch(Recorder, "track", track)


@fault("growth_below_old_peak", row="host memory while a model is built empty",
       test="tests/test_init_memory.py::test_a_whole_model_written_below_an_earlier_peak_is_caught")
def _growth_below_old_peak() -> None:
    """init_empty writes every tensor the constructor registers (a whole model's pages, as a
    normal build then moved to meta would) and drops them all when the block ends: nothing kept,
    a whole model at the block's peak."""
    import contextlib

    from shardwise.engine import models
    from shardwise.weights.record import Recorder

    written: list[Any] = []

    def track(self: Any, param: Any, real: Any) -> None:
        track.__wrapped__(self, param, real)  # type: ignore[attr-defined]
        written.append(real)

    @contextlib.contextmanager
    def init_empty() -> Any:
        with init_empty.__wrapped__() as record:  # type: ignore[attr-defined]
            yield record
        for t in written:  # outside the recorder: plain writes
            t.detach().fill_(1.0)
        written.clear()

    _patch(Recorder, "track", track)
    _patch(models, "init_empty", init_empty)


@fault("keep_gathered_after_no_grad", row="every way transformers calls a sharded model",
       test="tests/test_direct_calls.py::test_a_direct_call_left_gathered_is_caught")
def _keep_gathered_after_no_grad() -> None:
    """A submodule called on its own (get_encoder()(...), model.shared(ids)) skips the cleanup
    after it: under no_grad nothing is resharded (zero2's root stays gathered until a later
    forward of the root reshards it)."""
    from shardwise.strategies import direct_calls

    def routed(forward: Any, depth: Any, run: Any, after: Any) -> Any:
        return routed.__wrapped__(forward, depth, run, lambda: None)  # type: ignore[attr-defined]

    _patch(direct_calls, "_routed", routed)


# -- tensor and sequence parallelism: sp on, per-rank shares (issue 47, items 3 and 5) ----------
@fault("sequence_parallel_off", row="sequence parallelism (`tests/test_sequence_parallel.py`",
       test="tests/test_sequence_parallel.py::test_sequence_parallel_switched_off_is_caught")
def _sequence_parallel_off() -> None:
    """`sequence_parallel: true` silently ignored: the model split as plain tensor parallelism
    (the same losses, weights and shares; the activations whole on every tp rank)."""
    from shardwise.strategies import steps  # the tensor-parallel step

    def apply(model: Any, plan: Any, mesh: Any, *, sequence_parallel: bool = False) -> Any:
        return apply.__wrapped__(model, plan, mesh, sequence_parallel=False)  # type: ignore[attr-defined]

    _patch(steps, "apply_tensor_parallel", apply)


@fault("zero1_whole_optimizer_state", row="tensor parallelism (`tests/test_tensor_parallel.py`",
       test="tests/test_tensor_parallel.py::test_zero1_keeping_the_whole_optimizer_state_is_caught")
def _zero1_whole_optimizer_state() -> None:
    """zero1 (the "flat" partition) with every rank owning every element: each steps, and keeps
    AdamW's state of, the whole of what it holds; the all-gather after the step then hands back
    what every rank computed alike, so the weights stay right."""
    from shardwise.strategies.sharded_optim import ShardedOptimizer, local_flat

    def ranges(self: Any, owned: Any) -> Any:
        if self.partition != "flat":
            return ranges.__wrapped__(self, owned)  # type: ignore[attr-defined]
        return [(gi, p, 0, local_flat(p).numel()) for gi, p in owned]

    _patch(ShardedOptimizer, "_ranges", ranges)


# -- the parallelism section, Accelerate's plugins (issues 43 and 44) -----------------------------
@fault("parallelism_swapped", row="the `parallelism` section",
       test="tests/test_parallel_dims.py::test_a_swapped_layout_is_caught")
def _parallelism_swapped() -> None:
    """The resolved sizes' two data-parallel dimensions swapped (dp_shard x dp_replicate): the
    same data-parallel size, ranks and losses, but the model replicated where it should be sharded."""
    import dataclasses

    from shardwise.strategies import base

    def resolve_sizes(*args: Any, **kwargs: Any) -> Any:
        sizes = resolve_sizes.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]
        return dataclasses.replace(sizes, dp_replicate=sizes.dp_shard, dp_shard=sizes.dp_replicate)

    _patch(base, "resolve_sizes", resolve_sizes)


@fault("plugin_wrap_dropped", row="Accelerate's plugin objects",
       test="tests/test_accelerate_plugins.py::test_a_plugin_field_dropped_is_caught")
def _plugin_wrap_dropped() -> None:
    """The FSDP plugin's `transformer_cls_names_to_wrap` lost on the way to the translator (the
    blocks are then detected, so the numbers stay: only the settings say it)."""
    from shardwise.accelerate import plugins

    def fsdp_fields(plugin: Any) -> dict[str, Any]:
        out: dict[str, Any] = fsdp_fields.__wrapped__(plugin)  # type: ignore[attr-defined]
        out.pop("transformer_layer_cls_to_wrap", None)
        return out

    _patch(plugins, "fsdp_fields", fsdp_fields)


# -- context parallelism: the whole sequence's loss, attention over every block (issue 45) ------
@fault("context_loss_not_summed", row="context parallelism (`tests/test_context_parallel.py`",
       test="tests/test_context_parallel.py::test_a_loss_left_unsummed_is_caught")
def _context_loss_not_summed() -> None:
    """Each rank of a context group keeps its own tokens' share of the loss (divided by the whole
    sequence's tokens) instead of the group's sum: the logged loss is a part, the gradient half."""
    from shardwise.strategies.context_parallel import ContextParallel

    _patch(ContextParallel, "whole_loss", lambda self, output: output)


@fault("aux_loss_dropped", row="expert parallelism (`tests/test_expert_parallel.py`",
       test="tests/test_expert_parallel.py::test_a_load_balancing_loss_dropped_is_caught")
def _aux_loss_dropped() -> None:
    """The router's load-balancing loss switched off for every prepared model (its config's
    output_router_logits set False when the experts are split): the run trains the language
    loss alone, which a check against shardwise's own run with the same fault cannot see."""
    from shardwise.strategies import steps

    def split(model: Any, dims: Any) -> Any:
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "output_router_logits", False):
            config.output_router_logits = False
        return split.__wrapped__(model, dims)  # type: ignore[attr-defined]

    _patch(steps, "expert_parallel_step", split)


@fault("context_mask_dropped", row="context parallelism (`tests/test_context_parallel.py`",
       test="tests/test_context_parallel.py::test_a_dropped_attention_mask_is_caught")
def _context_mask_dropped() -> None:
    """The split forgets the batch's attention mask (every key attendable): right-padded rows
    never show it (their padding comes after every real token, and its labels are -100), left-
    padded ones do (the real tokens attend to the padding before them)."""
    from shardwise.strategies.context_parallel import ContextParallel

    def split_inputs(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        return split_inputs.__wrapped__(self, args, {k: v for k, v in kwargs.items()  # type: ignore[attr-defined]
                                                     if k != "attention_mask"})

    _patch(ContextParallel, "split_inputs", split_inputs)


@fault("experts_gradient_summed", row="expert parallelism (`tests/test_expert_parallel.py`",
       test="tests/test_expert_parallel.py::test_experts_gradients_left_summed_are_caught")
def _experts_gradient_summed() -> None:
    """The experts' gradients left as the all-to-all's backward sums them over every rank's
    tokens, not divided by the data-parallel size: the losses of the first step look right."""
    from shardwise.strategies import expert_parallel

    _patch(expert_parallel, "_divided", lambda x, n: x)


@fault("experts_init_dropped", row="expert parallelism (`tests/test_expert_parallel.py`",
       test="tests/test_expert_parallel.py::test_an_empty_build_losing_the_experts_init_is_caught")
def _experts_init_dropped() -> None:
    """The split experts of a model built under init_empty() lose their constructor's recorded
    init (the step replacing them without carrying it over): the modules' own initializers fill
    them instead, from another point of the generator, every value plausible."""
    import contextlib

    from shardwise.strategies import steps

    _patch(steps, "recipes_kept", lambda model: contextlib.nullcontext())


@fault("experts_replicas_unsummed", row="expert parallelism (`tests/test_expert_parallel.py`",
       test="tests/test_expert_parallel.py::test_hybrid_replicas_left_unsummed_are_caught")
def _experts_replicas_unsummed() -> None:
    """Hybrid sharding's replicas each stepping their experts on their own tokens' gradient (never
    summed across replicas): the first loss is right, the replicas drift apart after."""
    from shardwise.strategies import fsdp

    _patch(fsdp, "sum_over_replicas", lambda model: None)


@fault("experts_edp_unsummed", row="expert parallelism (`tests/test_expert_parallel.py`",
       test="tests/test_expert_parallel.py::test_zero1_experts_holders_unsummed_are_caught")
def _experts_edp_unsummed() -> None:
    """zero1 at ep 2 x data 2: the two ranks holding the same experts (DDP leaves them out) each
    step them on their own tokens' gradient, never summed: the first loss is right, then they drift."""
    from shardwise.strategies import ddp

    _patch(ddp, "sum_over_replicas", lambda model: None)


@fault("experts_optimizer_unsplit", row="expert parallelism (`tests/test_expert_parallel.py`",
       test="tests/test_expert_parallel.py::test_zero1_experts_optimizer_kept_whole_is_caught")
def _experts_optimizer_unsplit() -> None:
    """zero1 at ep 2 x data 2: each rank steps its experts whole, their optimizer state not split
    over the ranks holding the same experts (every number stays right)."""
    from shardwise.strategies import ddp

    held = ddp.experts_held_whole
    _patch(ddp, "experts_held_whole", lambda model, dims: dict.fromkeys(held(model, dims)))


@fault("experts_fused_swapped", row="expert parallelism (`tests/test_expert_parallel.py`",
       test="tests/test_expert_parallel.py::test_experts_fused_in_the_wrong_order_are_caught")
def _experts_fused_swapped() -> None:
    """Experts stored one by one fused with up before gate (each expert's two halves swapped):
    every shape and key matches, every value is one the file holds."""
    from shardwise.weights import loading

    swapped = {name: tuple(tuple(reversed(names)) for names in namings)
               for name, namings in loading._FUSED_FROM.items()}
    loading._FUSED_FROM = swapped  # (a table, not a function: `_patch` wraps functions)


@fault("experts_hybrid_units_within_group", row="expert parallelism (`tests/test_expert_parallel.py`",
       test="tests/test_expert_parallel.py::test_hybrid_experts_units_left_within_the_group_are_caught")
def _experts_hybrid_units_within_group() -> None:
    """Hybrid sharding with ep below the sharding group: the experts' FSDP units over their
    holders within the replica only (not hybrid over the replicas too): each replica steps its
    experts on its own tokens; the first loss is right, the replicas drift apart after."""
    from shardwise.strategies import expert_parallel

    real = expert_parallel.expert_mesh

    def within(dims: Any) -> Any:
        ep, edp = real(dims)
        return ep, edp["edp"] if edp is not None and edp.ndim == 2 else edp

    _patch(expert_parallel, "expert_mesh", within)


# -- the core rows: every strategy equals one process, per-rank memory (test_equivalence) ---------
@fault("accumulation_undivided", row="per-micro-batch losses, clip norms, final full weights",
       test="tests/test_equivalence.py::test_gradients_left_undivided_under_accumulation_are_caught")
def _accumulation_undivided() -> None:
    """`backward` no longer divides by grad_accum_steps: each step's gradient is the sum of its
    micro-batches', not their mean (AdamW hides most of the scale; the clipped norms do not)."""
    from shardwise.engine.session import Session

    def backward(self: Any, loss: Any, *, num_items: Any = None, **kwargs: Any) -> None:
        self.step_state.items.add(num_items)
        self.strategy.backward(self.strategy.precision.scale_loss(loss), **kwargs)

    _patch(Session, "backward", backward)


@fault("fsdp_shards_nothing", row="per-rank tensor bytes",
       test="tests/test_equivalence.py::test_a_zero3_that_shards_nothing_is_caught")
def _fsdp_shards_nothing() -> None:
    """zero2/zero3 lay nothing out: every rank keeps whole parameters, gradients and optimizer
    state, and trains on its own gradients (the numbers drift, quietly)."""
    from shardwise.strategies import fsdp

    _patch(fsdp, "apply_fsdp", lambda model, **kwargs: None)


@fault("overflow_verdict_local", row="fp16 overflow",
       test="tests/test_precision.py::test_an_overflow_verdict_kept_local_is_caught")
def _overflow_verdict_local() -> None:
    """The fp16 scaler's inf/nan verdict not all-reduced: a rank that alone sees an overflow in
    its gradient shard skips the step while the others take it."""
    import torch

    from shardwise.strategies.precision import DynamicLossScaler, local_tensor

    @torch.no_grad()
    def unscale_and_check(self: Any, grads: Any) -> bool:
        finite = True
        for g in grads:
            local = local_tensor(g)
            local.mul_(1.0 / self.scale)
            finite = finite and bool(torch.isfinite(local).all())
        return finite

    _patch(DynamicLossScaler, "unscale_and_check", unscale_and_check)


@fault("script_metrics_keep_repeats", row="transformers' `run_*_no_trainer.py` pattern",
       test="tests/test_no_trainer_scripts.py::test_planted_script_metrics_keep_repeats_is_caught")
@fault("metrics_keep_repeats", row="`gather_for_metrics` on 13 samples",
       test="tests/test_engine.py::test_gather_for_metrics_keeping_the_repeats_is_caught")
def _metrics_keep_repeats() -> None:
    """`gather_for_metrics` keeps the samples the loader repeated to even out its last batch."""
    from shardwise import Engine

    _patch(Engine, "real_in_last_batch", lambda self: None)


@fault("rng_not_restored", row="exact resume: 8 steps vs 4",
       test="tests/test_checkpoint.py::test_a_resume_that_drops_the_rng_state_is_caught")
def _rng_not_restored() -> None:
    """A resume loads weights, optimizer, scheduler and sampler position, but not the RNG state."""
    from shardwise.checkpoint import sharded

    _patch(sharded, "_set_rng_state", lambda state: None)


@fault("hybrid_replicas_unsynced", row="hybrid sharding, 4 processes as 2 groups of 2",
       test="tests/test_hybrid.py::test_replicas_left_unsynced_are_caught")
def _hybrid_replicas_unsynced() -> None:
    """Hybrid sharding's groups each shard over their own ranks and never all-reduce across the
    replicas: each group trains on its own half of the batch."""
    from shardwise.strategies.fsdp import FSDPStrategy

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        init.__wrapped__(self, *args, **kwargs)  # type: ignore[attr-defined]
        if self.mesh.ndim == 2:
            self.mesh = self.mesh["dp_shard"]

    _patch(FSDPStrategy, "__init__", init)


@fault("precision_ignored", row="bf16, fp16",
       test="tests/test_precision.py::test_a_precision_left_at_fp32_is_caught")
def _precision_ignored() -> None:
    """bf16 asked for, fp32 computed: the precision component takes the name but computes in
    fp32 (no autocast, FSDP's parameters gathered in fp32); every loss stays finite and close."""
    import torch

    from shardwise.strategies.precision import Precision

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        init.__wrapped__(self, *args, **kwargs)  # type: ignore[attr-defined]
        self.dtype = torch.float32

    _patch(Precision, "__init__", init)


@fault("items_count_local", row="token-weighted loss",
       test="tests/test_token_loss.py::test_a_count_of_items_left_local_is_caught")
def _items_count_local() -> None:
    """`backward(loss_sum, num_items=n)`: the step's count of items taken as this process's count
    times the world, never summed over the processes (exact only when every rank has as many)."""
    import torch

    from shardwise.engine.items import ItemCount

    def agree(self: Any, info: Any, accum: int) -> float:
        n = float(torch.as_tensor(self.local, dtype=torch.float64).item()) * info.world_size
        return info.world_size * accum / n if n > 0 else 1.0

    _patch(ItemCount, "_agree", agree)


@fault("checkpointing_not_applied", row="activation checkpointing modes",
       test="tests/test_ac_modes.py::test_a_mode_the_engine_never_applies_is_caught")
def _checkpointing_not_applied() -> None:
    """The engine takes `activation_checkpointing` and never wraps a block: the numbers are
    exactly right, every activation is kept."""
    from shardwise.strategies import steps

    _patch(steps, "apply_activation_checkpointing", lambda *args, **kwargs: None)


@fault("optimizer_state_dropped", row="reshard matrix",
       test="tests/test_checkpoint.py::test_a_resume_that_drops_the_optimizer_state_is_caught")
def _optimizer_state_dropped() -> None:
    """A load restores weights, loop state and RNG, but leaves the optimizer's state as a fresh
    optimizer has it (Adam's moments zero)."""
    from shardwise.strategies.base import InPlaceRunner
    from shardwise.strategies.sharded_optim import ShardedOptimizer

    for cls in (InPlaceRunner, ShardedOptimizer):
        _patch(cls, "load_checkpoint_state", lambda self, model, state: None)


@fault("adapter_not_merged", row="LoRA through peft",
       test="tests/test_adapters.py::test_an_export_that_drops_the_adapter_is_caught")
def _adapter_not_merged() -> None:
    """`save_model(merge_adapters=True)` writes the base model with the adapter unloaded, not
    merged: the right keys and shapes, the untrained model's outputs."""
    import copy

    import peft
    import torch

    from shardwise.weights import adapters

    def unmerged(module: Any, state: Any) -> Any:
        (name,) = module.peft_config
        base = module.get_base_model()
        with torch.device("meta"):
            fresh = peft.get_peft_model(type(base)(copy.deepcopy(base.config)),
                                        copy.deepcopy(module.peft_config[name]), adapter_name=name)
        fresh.load_state_dict(state, strict=True, assign=True)
        plain = fresh.unload()
        return plain, {k: v for k, v in plain.state_dict().items() if not v.is_meta}

    _patch(adapters, "_merged", unmerged)


@fault("deepspeed_clip_unset", row="**DeepSpeed backend**",
       test="tests/test_deepspeed.py::test_a_clip_bound_never_handed_to_deepspeed_is_caught")
def _deepspeed_clip_unset() -> None:
    """backend deepspeed: `clip_grad_norm_` computes and returns the global norm, but the bound is
    never handed to DeepSpeed's optimizer, whose step then does not clip."""
    from shardwise.strategies.deepspeed import internals

    _patch(internals, "set_clip_bound", lambda zero_opt, bound: None)


@fault("async_stage_aliases", row="asynchronous checkpoints",
       test="tests/test_checkpoint_async.py::test_a_stage_that_aliases_the_live_tensors_is_caught")
def _async_stage_aliases() -> None:
    """An asynchronous save's staging hands the background writer the live CPU tensors instead of
    copies: a write that overlaps the next step stores that step's weights."""
    from shardwise.checkpoint import background

    _patch(background._Copier, "tensor", lambda self, t: t)


@fault("recipes_not_replayed", row="init_empty + prepare vs a normal build",
       test="tests/test_big_models.py::test_an_empty_build_that_skips_the_recorded_init_is_caught")
def _recipes_not_replayed() -> None:
    """init_empty never replays the constructor's recorded writes: the modules' own initializers
    fill every tensor instead (plausible values, another model)."""
    from shardwise.weights.materialize import _Fill

    _patch(_Fill, "by_recipes", lambda self: None)


# -- in-process rows: configs, files, careless calls (planted_here) -----------------------------
@fault("loop_checks_skipped", row="21 malformed configs",
       test="tests/test_config.py::test_a_config_check_left_out_is_caught")
def _loop_checks_skipped() -> None:
    """The config's loop checks (accumulation, seed, clipping, batch sizes) never run: a bad
    value starts the launch and fails, if at all, deep in training."""
    from shardwise.config import tree

    _patch(tree, "_check_training", lambda section: None)


@fault("flat_key_overrides_section", row="one config tree: sections and flat keys",
       test="tests/test_config.py::test_a_flat_key_overriding_its_section_is_caught")
def _flat_key_overrides_section() -> None:
    """The agreement of a flat key with its section's field reads every field of the section as
    unwritten: `parallelism: {tp: 2}` with `tensor_parallel_size: 4` runs with 4, silently."""
    from shardwise.config import tree

    _patch(tree, "_written", lambda given, cls: {})


@fault("section_value_always_wins", row="one config tree: sections and flat keys",
       test="tests/test_config.py::test_a_section_value_always_winning_is_caught")
def _section_value_always_wins() -> None:
    """Where a section and a flat key both write a field, the section's value is taken and the
    flat key ignored, silently: `parallelism: {tp: 1}` with `tensor_parallel_size: 2` runs tp 1."""
    from shardwise.config import tree

    _patch(tree, "_agreed", lambda path, written, key, value: written.get(path.split(".", 1)[1], value))


@fault("refusal_names_one_spelling", row="one config tree: sections and flat keys",
       test="tests/test_config.py::test_a_refusal_naming_the_other_spelling_is_caught")
def _refusal_names_one_spelling() -> None:
    """A refusal names the setting as its check does (a flat key, or a type error's section
    path), whichever spelling the file or the keywords used."""
    from shardwise.config import files, tree

    for module in (files, tree):
        _patch(module, "as_written", lambda message, spelled: message)


@fault("clip_bound_unchecked", row="careless calls: `clip_grad_norm_(ps, -1.0)`",
       test="tests/test_errors.py::test_a_clip_bound_left_unchecked_is_caught")
def _clip_bound_unchecked() -> None:
    """`clip_grad_norm_` takes any bound: -1.0 scales every gradient by a negative factor."""
    from shardwise import Engine

    def clip(self: Any, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        with self._supervisor.timeouts():
            return self.session.clip_grad_norm(parameters, max_norm, norm_type)

    _patch(Engine, "clip_grad_norm_", clip)


@fault("cut_line_unsaid", row="`shardwise report` of a metrics.jsonl whose last line was cut",
       test="tests/test_observe.py::test_a_report_silent_on_a_cut_line_is_caught")
def _cut_line_unsaid() -> None:
    """`shardwise report` drops a crash's unfinished last line without a word."""
    from shardwise.runtime import report

    _patch(report, "read_records", lambda run_dir, skipped=None: report.read_records.__wrapped__(run_dir))


@fault("clip_flag_sticky", row="the script clips with 0.01 on one step only",
       test="tests/test_equivalence.py::test_a_clip_bound_that_outlives_its_step_is_caught")
def _clip_flag_sticky() -> None:
    """"The script clipped this step" is never reset: after one clip_grad_norm_ call the config's
    max_grad_norm is not applied again."""
    from shardwise.engine.step import StepState

    def begin_micro_step(self: Any, loader_at_end: bool) -> None:
        clipped = self.clipped
        begin_micro_step.__wrapped__(self, loader_at_end)  # type: ignore[attr-defined]
        self.clipped = clipped

    def end_step(self: Any) -> None:
        clipped = self.clipped
        end_step.__wrapped__(self)  # type: ignore[attr-defined]
        self.clipped = clipped

    _patch(StepState, "begin_micro_step", begin_micro_step)
    _patch(StepState, "end_step", end_step)


@fault("steps_of_the_first_optimizer", row="two optimizers, the first stepping every other iteration",
       test="tests/test_single_process.py::test_steps_counted_by_one_optimizer_are_caught")
def _steps_of_the_first_optimizer() -> None:
    """`engine.step` counts the steps of the first optimizer that stepped, not the boundaries."""
    from shardwise.engine.step import StepState

    firsts: dict[int, int] = {}

    def record_step(self: Any, optimizer_id: int) -> bool:
        counted = firsts.setdefault(id(self), optimizer_id) == optimizer_id
        if counted:
            self.optimizer_steps += 1
        return counted

    _patch(StepState, "record_step", record_step)


@fault("final_step_unsaved", row="`checkpoint_every_steps: 3`, 4 steps",
       test="tests/test_resilience.py::test_a_policy_that_forgets_the_final_step_is_caught")
def _final_step_unsaved() -> None:
    """end_training() takes every step for saved: a run whose last step falls between the
    policy's saves loses it."""
    from shardwise.checkpoint.manager import CheckpointManager

    _patch(CheckpointManager, "has_saved", lambda self, step: True)


@fault("reshard_after_forward_ignored", row="Accelerate YAMLs (every distributed_type",
       test="tests/test_config.py::test_a_mistranslated_key_is_caught")
def _reshard_after_forward_ignored() -> None:
    """An Accelerate FSDP2 YAML's `fsdp_reshard_after_forward: false` (zero2) read as FSDP's
    default: the run shards parameters too (zero3), quietly."""
    from shardwise.config import translate

    _patch(translate, "_fsdp_strategy", lambda plain, source: {"strategy": "zero3"})


@fault("load_rows_from_zero", row="a GPT-2 saved by `save_pretrained` in 3 files",
       test="tests/test_big_models.py::test_every_rank_reading_the_first_rows_is_caught")
def _load_rows_from_zero() -> None:
    """Loading pretrained weights into shards: every rank reads the first rows of each tensor,
    not its own (every shape right, every value one the file holds)."""
    import torch
    from torch.distributed.tensor import DTensor

    from shardwise.distributed.internals import local_tensor
    from shardwise.strategies import base

    @torch.no_grad()
    def copy_into(target: Any, key: str, read: Any) -> None:
        if isinstance(target, DTensor):
            local = local_tensor(target)
            if local.numel():
                local.copy_(read(key, slice(0, local.shape[0])).reshape(local.shape))
            return
        copy_into.__wrapped__(target, key, read)  # type: ignore[attr-defined]

    _patch(base, "copy_into", copy_into)  # (where the strategies' load calls it)


@fault("clip_over_every_model", row="two models, two optimizers (one made after prepare)",
       test="tests/test_engine.py::test_a_clip_over_every_model_is_caught")
def _clip_over_every_model() -> None:
    """`clip_grad_norm_(a.parameters(), ...)` measures and clips the gradients of every prepared
    model, not the ones it was given."""
    from shardwise.engine.session import Session

    def clip_grad_norm(self: Any, parameters: Any, max_norm: float, norm_type: float) -> Any:
        every = [p for m in self.models for p in m.parameters()]
        return clip_grad_norm.__wrapped__(self, every, max_norm, norm_type)  # type: ignore[attr-defined]

    _patch(Session, "clip_grad_norm", clip_grad_norm)


@fault("export_rounded", row="`save_model` / `shardwise export` then `from_pretrained`",
       test="tests/test_checkpoint.py::test_an_export_rounded_on_the_way_is_caught")
def _export_rounded() -> None:
    """save_model writes fp32 weights through bf16 (a dtype conversion on the way): the files
    load, every shape right, every value a little off."""
    import torch

    from shardwise.engine import models

    def save_weights(module: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        rounded = {k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v
                   for k, v in state.items()}
        return save_weights.__wrapped__(module, rounded, *args, **kwargs)  # type: ignore[attr-defined]

    _patch(models, "save_weights", save_weights)


@fault("override_unsaid", row="the code's keywords against the launcher's own resolved file",
       test="tests/test_config.py::test_an_override_said_nowhere_is_caught")
def _override_unsaid() -> None:
    """A keyword in code silently wins over the value the user set in the launch's config file."""
    from shardwise.engine import engine

    _patch(engine, "config_from_code",
           lambda config, kwargs: (engine.config_from_code.__wrapped__(config, kwargs)[0], []))


@fault("deepspeed_config_unclipped", row="`max_grad_norm` from the config, no clip call in the loop",
       test="tests/test_deepspeed.py::test_a_config_bound_never_handed_to_deepspeed_is_caught")
def _deepspeed_config_unclipped() -> None:
    """backend deepspeed: the config's max_grad_norm never reaches DeepSpeed's own config
    (`gradient_clipping` 0): a loop that leaves clipping to the config never clips."""
    from shardwise.strategies.deepspeed import strategy

    def deepspeed_config(*args: Any, **kwargs: Any) -> Any:
        out = deepspeed_config.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]
        return {**out, "gradient_clipping": 0.0}

    _patch(strategy, "deepspeed_config", deepspeed_config)


@fault("deepspeed_export_rounded", row="`save_model` under DeepSpeed ZeRO-3, then `from_pretrained`",
       test="tests/test_deepspeed.py::test_a_zero3_save_model_rounded_on_the_way_is_caught")
def _deepspeed_export_rounded() -> None:
    """backend deepspeed: save_model writes the gathered fp32 weights through bf16."""
    _export_rounded()


@fault("deepspeed_optimizer_dropped", row="checkpoints across backends",
       test="tests/test_deepspeed.py::test_a_deepspeed_load_that_drops_the_optimizer_state_is_caught")
def _deepspeed_optimizer_dropped() -> None:
    """backend deepspeed: a load restores the weights but leaves DeepSpeed's optimizer state fresh."""
    from shardwise.strategies.deepspeed.runner import DeepSpeedRunner

    _patch(DeepSpeedRunner, "load_checkpoint_state", lambda self, model, state: None)


@fault("host_kernel_ignored", row="`host_kernel=\"deepspeed\"`",
       test="tests/test_deepspeed.py::test_a_host_kernel_setting_ignored_is_caught")
def _host_kernel_ignored() -> None:
    """host_kernel="deepspeed" accepted and never used: torch's own step runs (the numbers stay
    right; the speed the user asked for does not come)."""
    from shardwise.strategies import host_step, sharded_optim

    for owner in (host_step, sharded_optim):
        _patch(owner, "host_kernel", lambda *args, **kwargs: None)


@fault("restart_from_zero", row="`load_state()` finding nothing",
       test="tests/test_resilience.py::test_a_restart_that_starts_from_zero_is_caught")
def _restart_from_zero() -> None:
    """A restarted attempt that finds no checkpoint starts again from step 0, although an earlier
    attempt of the same run saved one (elsewhere: another machine's checkpoint_dir)."""
    from shardwise.checkpoint import run_record

    _patch(run_record, "this_run", lambda *args, **kwargs: [])


@fault("heartbeat_never_read", row="the run lock after a crash",
       test="tests/test_run_lock.py::test_a_lock_whose_heartbeat_is_never_read_is_caught")
def _heartbeat_never_read() -> None:
    """Every lock's heartbeat reads as stale: a live run on another machine is taken over, and two
    runs write one folder."""
    from shardwise.checkpoint import runlock

    _patch(runlock, "heartbeat_age", lambda lock: float("inf"))


@fault("log_tensors_as_lists", row="`log()` with a 2x3 tensor under a nested key",
       test="tests/test_observe.py::test_a_tensor_logged_as_a_list_is_caught")
def _log_tensors_as_lists() -> None:
    """`log()` writes a tensor of several elements as a nested list instead of refusing it:
    scalar-only trackers then drop the key without a word."""
    import torch

    from shardwise.runtime import trackers

    def scalar(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            return value.tolist()
        return scalar.__wrapped__(value, name)  # type: ignore[attr-defined]

    _patch(trackers, "_scalar", scalar)


@fault("loaded_into_meta_dropped", row="pretrained keys under `module.`",
       test="tests/test_init_and_load.py::test_values_loaded_into_an_empty_model_and_dropped_are_caught")
def _loaded_into_meta_dropped() -> None:
    """`model.load_state_dict(sd)` on a model built under init_empty copies into the meta tensors
    (a no-op, as torch's own): prepare then initializes what the user loaded."""
    from shardwise.weights import materialize

    _patch(materialize, "_load_into_meta", lambda *args, **kwargs: None)


@fault("frozen_optimizer_accepted", row="a frozen model with its own optimizer",
       test="tests/test_finetune.py::test_an_optimizer_over_a_frozen_model_accepted_is_caught")
def _frozen_optimizer_accepted() -> None:
    """An optimizer over a model prepared for inference only is accepted: that model gets no
    gradient synchronisation, and each rank would train its own copy."""
    from shardwise.engine import engine

    _patch(engine, "check_inference_models", lambda models, optimizers: None)


@fault("engine_seeds_torch", row="the silent differences",
       test="tests/test_observe.py::test_an_engine_that_seeds_the_script_is_caught")
def _engine_seeds_torch() -> None:
    """An Engine made without a seed seeds torch anyway (a default of 0): the script's own
    `set_seed` before it is undone, silently."""
    import torch

    from shardwise import Engine

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        init.__wrapped__(self, *args, **kwargs)  # type: ignore[attr-defined]
        torch.manual_seed(0)

    _patch(Engine, "__init__", init)


@fault("no_sync_reduces", row="Accelerate's helpers",
       test="tests/test_accelerate_extras.py::test_a_no_sync_that_reduces_anyway_is_caught")
def _no_sync_reduces() -> None:
    """A sharded model's `model.no_sync()` defers nothing: every micro-batch's gradients are
    reduce-scattered at once (the numbers stay right; the communication saved is not)."""
    import contextlib

    from shardwise.strategies import fsdp

    _patch(fsdp, "_model_no_sync", contextlib.contextmanager(lambda model: (yield)))


@fault("memory_of_rank0_only", row="metrics (`tests/test_observe.py`)",
       test="tests/test_observe.py::test_a_record_with_one_ranks_memory_is_caught")
def _memory_of_rank0_only() -> None:
    """The metrics record's memory holds process 0's figures only: a rank running out of memory
    elsewhere is invisible."""
    from shardwise.runtime.metrics import Meter

    def record(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = record.__wrapped__(self, *args, **kwargs)  # type: ignore[attr-defined]
        out["memory"] = out["memory"][:1]
        return out

    _patch(Meter, "record", record)


@fault("eval_forward_left_gathered", row="evaluation and generation between training steps",
       test="tests/test_eval_generate.py::test_an_eval_forward_left_gathered_is_caught")
def _eval_forward_left_gathered() -> None:
    """A forward under no_grad leaves what it gathered in place (no backward follows to free it):
    the whole model sits on every rank until the next training step."""
    from shardwise.strategies import fsdp

    _patch(fsdp, "reshard_after_no_grad", lambda model, args, output: None)


@fault("evaluation_model_sharded", row="DPO with a frozen reference",
       test="tests/test_finetune.py::test_a_reference_prepared_for_evaluation_but_sharded_is_caught")
def _evaluation_model_sharded() -> None:
    """Under zero2 a model prepared for inference only is sharded like a trained one (FSDP units,
    gathered at every forward) instead of a whole replica."""
    from shardwise.strategies import fsdp

    _patch(fsdp, "for_inference", lambda model: False)


@fault("loader_position_dropped", row="mid-epoch resume with dropout",
       test="tests/test_observe.py::test_a_resume_at_the_epochs_start_is_caught")
def _loader_position_dropped() -> None:
    """A resumed loader starts its epoch again from the first batch, not where the checkpoint
    stopped (every batch plausible, some seen twice)."""
    from shardwise.engine.data import PreparedDataLoader

    def load_state_dict(self: Any, state: Any) -> None:
        load_state_dict.__wrapped__(self, {**state, "samples": 0})  # type: ignore[attr-defined]

    _patch(PreparedDataLoader, "load_state_dict", load_state_dict)


@fault("plan_experts_gathered", row="the planner under expert parallelism",
       test="tests/test_plan_ep.py::test_a_planner_that_gathers_the_experts_is_caught")
def _plan_experts_gathered() -> None:
    """The planner's communication under expert parallelism counted as without it: the experts
    gathered and reduced with every other parameter, no all-to-all."""
    from shardwise.plan import comm, planner

    def gathered(fitted: Any, cand: Any, req: Any, batch: int) -> Any:
        return comm.step_comm(cand.strategy, fitted.linear("parameters", batch), req.precision,
                              world_size=req.world_size, nodes=req.nodes)

    _patch(planner, "_expert_volume", gathered)


@fault("plan_hybrid_experts_whole_world", row="the planner under expert parallelism",
       test="tests/test_plan_ep.py::test_a_planner_ignoring_the_hybrid_group_under_ep_is_caught")
def _plan_hybrid_experts_whole_world() -> None:
    """Hybrid sharding ignored in the planner's bytes under expert parallelism (as before it was
    planned): the rest of the model and the experts counted as fully sharded over every rank."""
    import dataclasses

    from shardwise.plan import planner

    def whole_world(fitted: Any, cand: Any, req: Any, batch: int) -> Any:
        return whole_world.__wrapped__(fitted, dataclasses.replace(cand, shard_group_size=None),  # type: ignore[attr-defined]
                                       req, batch)

    _patch(planner, "_expert_volume", whole_world)


@fault("ring_own_block_only", row="context parallelism (`tests/test_context_parallel.py`",
       test="tests/test_context_parallel.py::test_a_ring_standing_still_is_caught")
def _ring_own_block_only() -> None:
    """The ring's blocks never move on: each rank attends to its own tokens only (a ring whose
    send/recv got lost); the shapes and the loss's size all look right."""
    from shardwise.strategies import attention

    _patch(attention._Ring, "source", lambda self, step: self.rank)


@fault("context_outputs_local", row="context parallelism where users look",
       test="tests/test_context_parallel_models.py::test_outputs_left_local_are_caught")
def _context_outputs_local() -> None:
    """The model's per-token outputs left as each rank computed them (its share of the tokens, in
    its split's order), the loss alone made whole: what a loop reads from the logits is wrong."""
    from shardwise.strategies.context_parallel import ContextParallel

    _patch(ContextParallel, "gather", lambda self, x: x)


@fault("quantized_sharded", row="a bitsandbytes 4-bit base",
       test="tests/test_quantized.py::test_a_sharded_4bit_base_accepted_is_caught")
def _quantized_sharded() -> None:
    """A 4-bit base is sharded like any frozen weight: the packed storage cut without its scales."""
    import importlib

    for name in ("shardwise.strategies.fsdp", "shardwise.strategies.deepspeed.strategy"):
        owner = importlib.import_module(name)
        _patch(owner, "refuse_sharded_quantized", lambda model, strategy: None)


@fault("ring_merge_in_bf16", row="context parallelism (`tests/test_context_parallel.py`",
       test="tests/test_context_parallel.py::test_a_ring_merging_in_bf16_is_caught")
def _ring_merge_in_bf16() -> None:
    """The ring's online softmax kept in its inputs' dtype: under bf16 every block's merge rounds
    the output and the log-sum-exp again (the losses stay within bf16's own distance of fp32)."""
    from shardwise.strategies import attention

    attention.MERGE_DTYPE = None  # type: ignore[assignment]


# -- the package's shape, bad checkpoints, the tests of the tests (in process) -------------------
@fault("lazy_engine_import", row="the package's shape (`tests/test_layering.py`)",
       test="tests/test_layering.py::test_planted_lazy_engine_import_is_caught")
def _lazy_engine_import() -> None:
    """A function of the checkpoint package imports the Engine inside its body (the usual quick
    fix for a circular import): the source is read as if `checkpoint/sharded.py` ended with it."""
    from pathlib import Path as _Path

    def read_text(self: _Path, *args: Any, **kwargs: Any) -> str:
        text: str = read_text.__wrapped__(self, *args, **kwargs)  # type: ignore[attr-defined]
        if self.as_posix().endswith("shardwise/checkpoint/sharded.py"):
            text += "\n\ndef _engine():\n    from ..engine.engine import Engine\n\n    return Engine\n"
        return text

    _patch(_Path, "read_text", read_text)


@fault("engine_state_unpickled", row="15 bad checkpoints",
       test="tests/test_checkpoint.py::test_planted_engine_state_unpickled_is_caught")
def _engine_state_unpickled() -> None:
    """The checkpoint's small files (engine.pt, the RNG states) read with full pickle loading, as
    torch.load did before weights_only became its default: code stored in them runs."""
    import torch

    from shardwise.checkpoint import sharded

    _patch(sharded, "load_safe", lambda path: torch.load(path, weights_only=False, map_location="cpu"))


@fault("caught_accepts_a_pass", row="the tests of the tests",
       test="tests/unit/test_unit_planted.py::test_planted_caught_accepts_a_pass_is_caught")
def _caught_accepts_a_pass() -> None:
    """`caught` returns quietly when the guarantee's check passes under its fault, so every planted
    test would pass whatever its check found."""
    import sys

    def accepts(check: Callable[..., Any], *args: Any, must: str, **kwargs: Any) -> str:
        try:
            check(*args, **kwargs)
        except (AssertionError, pytest.fail.Exception) as err:
            return str(err)
        return ""

    _patch(sys.modules[__name__], "caught", accepts)


@fault("caught_accepts_any_failure", row="the tests of the tests",
       test="tests/unit/test_unit_planted.py::test_planted_caught_accepts_any_failure_is_caught")
def _caught_accepts_any_failure() -> None:
    """`caught` counts any failure of the check as the fault's: a worker's crash turned into an
    assertion, or a finding that is not the one the fault makes (the check failed on something
    else), passes every planted test."""
    import sys

    def accepts(check: Callable[..., Any], *args: Any, must: str, **kwargs: Any) -> str:
        try:
            check(*args, **kwargs)
        except (AssertionError, pytest.fail.Exception) as err:
            return str(err).strip().splitlines()[0]
        raise AssertionError("went unnoticed")

    _patch(sys.modules[__name__], "caught", accepts)


@fault("lone_generate_raises", row="the tests of the tests",
       test="tests/test_lone_calls.py::test_a_fault_that_only_raises_is_not_caught")
def _lone_generate_raises() -> None:
    """A "fault" that only makes the run fail: the main process's generate raises. It breaks no
    promise a check can see; `caught` must not count it (the worker's error propagates)."""
    from shardwise.engine.lone import LoneCalls

    def watch_generate(self: Any, target: Any, before: Any) -> None:
        def generate(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("planted: generate raised")

        target.__dict__["generate"] = generate

    _patch(LoneCalls, "watch_generate", watch_generate)


# -- launched examples and scripts ------------------------------------------------------------------
@fault("adapter_b_dropped", row="`examples/finetune_lora.py` under `shardwise launch`",
       test="tests/test_examples.py::test_planted_adapter_b_dropped_is_caught")
def _adapter_b_dropped() -> None:
    """The adapter export filters its tensors by one name too narrowly: lora_A is written,
    lora_B (the half that starts at zero and carries what training learned) is not; peft loads
    the folder with B at zero, the base model unchanged."""
    from shardwise.weights import adapters

    def save(module: Any, state: dict[str, Any], target: Any) -> None:
        save.__wrapped__(module, {k: v for k, v in state.items() if "lora_B" not in k}, target)  # type: ignore[attr-defined]

    _patch(adapters, "_save_adapter", save)

@fault("optimizer_bound_by_name", row="`examples/dpo.py` under `shardwise launch`",
       test="tests/test_examples.py::test_planted_optimizer_bound_by_name_is_caught")
def _optimizer_bound_by_name() -> None:
    """An optimizer made before `prepare` is rebound to the prepared parameters by name, taken from
    the first prepared model that has the name: DPO's frozen reference (a copy of the policy,
    prepared first) is handed the policy's optimizer, so the policy never moves."""
    from shardwise.engine import session as S

    current: list[Any] = []

    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        current[:] = [self]
        return prepare.__wrapped__(self, *args, **kwargs)  # type: ignore[attr-defined]

    def rebind(optimizer: Any, new_param: Callable[[Any], Any], rebind_state: Any) -> None:
        named = [dict(current[0].strategy.unwrap(m).named_parameters()) for m in current[0].models]

        def by_name(p: Any) -> Any:
            q = new_param(p)
            name = next(n for params in named for n, r in params.items() if r is q)
            return next(params[name] for params in named if name in params)

        rebind.__wrapped__(optimizer, by_name, rebind_state)  # type: ignore[attr-defined]

    _patch(S.Session, "prepare", prepare)
    _patch(S, "rebind_optimizer", rebind)


@fault("joins_share_keys", row="several Engines one after another in one process",
       test="tests/test_launch.py::test_planted_joins_share_keys_is_caught")
def _joins_share_keys() -> None:
    """Every join of a process group within a process uses the store keys of the first (the join
    count never moves): a later Engine's rendezvous can read the previous group's addresses. It
    reads them when another process reaches the join first, a race; so that the fault shows on
    every run, process 0 comes to each later join 3 s after the others (on a lucky run without
    the delay, process 0 overwrote its address before the other read it, and nothing hung)."""
    from shardwise.distributed import world

    joined = [0]

    def join_store(rank: int, *args: Any, **kwargs: Any) -> Any:
        if rank == 0 and joined[0]:
            time.sleep(3)
        joined[0] += 1
        world._JOINS[0] = 0
        return join_store.__wrapped__(rank, *args, **kwargs)  # type: ignore[attr-defined]

    _patch(world, "_join_store", join_store)


@fault("autotp_row_split_unread", row="DeepSpeed's AutoTP",
       test="tests/test_deepspeed_tp.py::test_planted_autotp_row_split_unread_is_caught")
def _autotp_row_split_unread() -> None:
    """The layers AutoTP splits along their input (o_proj, down_proj: DeepSpeed's LinearAllreduce)
    not read as split, as a new AutoTP layer class would be: each rank's part taken for the whole
    weight when the weights are gathered, saved or loaded."""
    from shardwise.strategies.deepspeed import internals

    def column_splits_only(module: Any) -> Any:
        found = column_splits_only.__wrapped__(module)  # type: ignore[attr-defined]
        return {k: split for k, split in found.items() if split.dim == 0}

    _patch(internals, "autotp_splits", column_splits_only)


@fault("deepspeed_loss_undivided", row="same config on `backend=\"torch\"` and",
       test="tests/test_deepspeed.py::test_a_deepspeed_loss_left_undivided_is_caught")
def _deepspeed_loss_undivided() -> None:
    """backend deepspeed: each micro-batch's loss reaches backward undivided by grad_accum_steps
    (2 in the check's runs; DeepSpeed's own accumulation count is 1): its gradients are twice
    the torch engine's (AdamW's steps hardly change; the clipped norms do)."""
    from shardwise.strategies.deepspeed.strategy import DeepSpeedStrategy

    def backward(self: Any, loss: Any, **kwargs: Any) -> None:
        backward.__wrapped__(self, loss * 2, **kwargs)  # type: ignore[attr-defined]

    _patch(DeepSpeedStrategy, "backward", backward)


@fault("deepspeed_optimizer_state_fresh", row="two models (AdamW; SGD made after prepare)",
       test="tests/test_deepspeed.py::test_optimizer_state_started_afresh_at_each_step_is_caught")
def _deepspeed_optimizer_state_fresh() -> None:
    """backend deepspeed: each step starts from an empty optimizer state (SGD's momentum buffers,
    AdamW's moments), as if DeepSpeed were handed a fresh copy of the user's optimizer each time."""
    from shardwise.strategies.deepspeed.runner import DeepSpeedRunner

    def step(self: Any) -> None:
        self.optimizer.state.clear()
        step.__wrapped__(self)  # type: ignore[attr-defined]

    _patch(DeepSpeedRunner, "step", step)


@fault("first_replica_loads_alone", row="hybrid checkpoints (`tests/test_hybrid_resume.py`)",
       test="tests/test_hybrid_resume.py::test_planted_first_replica_loads_alone_is_caught")
def _first_replica_loads_alone() -> None:
    """A hybrid load puts the weights into the first replica group only (as a load over the first
    group's shard mesh would); the other groups keep the weights they started with, and the
    next steps average gradients of two different models."""
    import torch
    import torch.distributed as dist

    from shardwise.checkpoint import manager

    def load(parts: Any, folder: Any) -> Any:
        dims = parts.strategy.dims
        if dims.dp_replicate == 1 or dist.get_rank() < dims.dp_shard:  # (the first group: ranks 0..G-1)
            return load.__wrapped__(parts, folder)  # type: ignore[attr-defined]
        params = [p for m in parts.models for p in m.parameters()]
        kept = [p.detach().clone() for p in params]
        out = load.__wrapped__(parts, folder)  # type: ignore[attr-defined]
        with torch.no_grad():
            for p, k in zip(params, kept):
                p.copy_(k)
        return out

    _patch(manager.sharded, "load", load)


# -- clusters: schedulers, preemption, crashes -------------------------------------------------------
@fault("requeue_skipped", row="a preempted SLURM job",
       test="tests/test_clusters.py::test_planted_requeue_skipped_is_caught")
def _requeue_skipped() -> None:
    """After a preempted SLURM job's workers saved and exited, its launcher exits with their status
    and never asks `scontrol requeue`: the job ends there, its checkpoint never resumed."""
    from shardwise.cli import launch

    _patch(launch, "requeue_slurm", lambda job, code: code)


@fault("node_rank_by_arrival", row="SLURM and Kubernetes (`tests/test_clusters.py",
       test="tests/test_clusters.py::test_planted_node_rank_by_arrival_is_caught")
def _node_rank_by_arrival() -> None:
    """The launcher no longer asks for torchrun's static rendezvous under a scheduler: c10d numbers
    the nodes by their arrival, so the node the scheduler calls 0 may hold global ranks 2 and 3."""
    import dataclasses
    import importlib

    main = importlib.import_module("shardwise.cli.main")  # (the package exports its function `main`)

    def detect(environ: Any) -> Any:
        found = detect.__wrapped__(environ)  # type: ignore[attr-defined]
        if found is None:
            return None
        return dataclasses.replace(found, found=tuple(f for f in found.found if f.field != "rdzv_backend"))

    _patch(main, "detect", detect)


@fault("slurm_restart_unread", row="a crashed SLURM job requeued on another host",
       test="tests/test_cluster_crash.py::test_planted_slurm_restart_unread_is_caught")
def _slurm_restart_unread() -> None:
    """The run lock reads SLURM's job id but not its restart count (SLURM_RESTART_COUNT): a requeued
    job is not known as a later attempt of the crashed one, whose lock it then cannot take over
    from another host until the lease runs out."""
    from shardwise.checkpoint import runlock

    def slurm() -> tuple[str, int]:
        return slurm.__wrapped__()[0], 0  # type: ignore[attr-defined]

    _patch(runlock, "_slurm", slurm)


@fault("divide_by_local_processes", row="two `shardwise launch --num-nodes 2 --node-rank {0,1}`",
       test="tests/test_launch.py::test_planted_divide_by_local_processes_is_caught")
def _divide_by_local_processes() -> None:
    """The gradient average divides by the processes of one node (LOCAL_WORLD_SIZE), not of the
    world: across nodes the gradients are summed (planted as the loss scaled by world / local
    processes: gloo has no pre-multiplied reduce for FSDP's own divide factor): at 2 nodes of 1
    process, twice the gradients."""
    import os

    from shardwise.strategies.base import Strategy

    def backward(self: Any, loss: Any, **kwargs: Any) -> None:
        nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        backward.__wrapped__(self, loss * nodes, **kwargs)  # type: ignore[attr-defined]

    _patch(Strategy, "backward", backward)


@fault("repeat_signal_exits", row="failures (`tests/test_resilience.py`, under `shardwise launch`)",
       test="tests/test_resilience.py::test_planted_repeat_signal_exits_is_caught")
def _repeat_signal_exits() -> None:
    """A worker that gets a second stop signal while it saves exits at once (the "press Ctrl-C
    again to force" pattern): the scheduler's SIGTERM and the launcher's forwarded one cut the
    checkpoint short."""
    import os

    from shardwise.runtime import supervision

    def on_signal(self: Any, signum: int, frame: Any) -> None:
        if self.preempted and os.getpid() == self.pid:
            os._exit(128 + signum)
        on_signal.__wrapped__(self, signum, frame)  # type: ignore[attr-defined]

    _patch(supervision._Process, "_on_signal", on_signal)


@fault("signal_arrival_unwatched", row="failures (`tests/test_resilience.py`",
       test="tests/test_resilience.py::test_a_signal_seen_only_by_its_handler_is_caught")
def _signal_arrival_unwatched() -> None:
    """No wakeup fd: the watch thread learns of a stop signal only when its Python handler runs,
    which a main thread waiting in a collective never lets happen."""
    from shardwise.runtime import supervision

    _patch(supervision._Process, "_set_wakeup", lambda self: None)


@fault("resume_counts_processes", row="faults under N-D layouts",
       test="tests/test_resilience_nd.py::test_planted_resume_counts_processes_is_caught")
def _resume_counts_processes() -> None:
    """A resumed DataLoader's position (in samples over the data-parallel ranks) rescaled to the
    processes, as if every process read its own batch: under tensor parallelism, whose ranks
    share their batch, the resumed epoch starts too far on (under data parallelism alone, right)."""
    import os

    from shardwise.engine.data import PreparedDataLoader

    def load_state_dict(self: Any, state: Any) -> None:
        ranks = self.total_batch_size // self.per_process_batch  # the data-parallel ranks
        processes = int(os.environ.get("WORLD_SIZE", "1"))
        load_state_dict.__wrapped__(self, {**state, "samples": state["samples"] * processes // ranks})  # type: ignore[attr-defined]

    _patch(PreparedDataLoader, "load_state_dict", load_state_dict)


@fault("real_script_scheduler_once", row="diffusers' real `train_unconditional.py`",
       test="tests/test_real_clients.py::test_planted_real_script_scheduler_once_is_caught")
def _real_script_scheduler_once() -> None:
    """A prepared scheduler steps once per `scheduler.step()`, where Accelerate's steps it once per
    process (a script sizes its schedule from the unsplit DataLoader)."""
    from shardwise.engine.loop_rules import LoopRules

    _patch(LoopRules, "scheduler_steps_per_call", lambda self, world: 1)


@fault("lone_ema_not_replayed", row="diffusers' real `train_unconditional.py`",
       test="tests/test_real_clients.py::test_planted_lone_ema_not_replayed_is_caught")
def _lone_ema_not_replayed() -> None:
    """The processes that serve the main process's lone calls after `wait_for_everyone()` run its
    forwards and gathers but not its EMA `store` / `copy_to` / `restore`: their shards keep the
    training weights while the main process's hold the EMA's."""
    from shardwise.engine.lone import LoneCalls

    _patch(LoneCalls, "_replay", lambda self, journal: None)


@fault("lone_generate_unwatched", row="the main process's calls alone after `wait_for_everyone()`",
       test="tests/test_lone_calls.py::test_planted_lone_generate_unwatched_is_caught")
def _lone_generate_unwatched() -> None:
    """A prepared model's generate left as the strategy made it: the engine's rendezvous comes at
    its first forward, after FSDP2 gathered the root for the whole generation."""
    from shardwise.engine.lone import LoneCalls

    def watch_generate(self: Any, target: Any, before: Any) -> None:
        return None

    _patch(LoneCalls, "watch_generate", watch_generate)


@fault("lone_generate_own_rng", row="the main process's calls alone after `wait_for_everyone()`",
       test="tests/test_lone_calls.py::test_planted_lone_generate_own_rng_is_caught")
def _lone_generate_own_rng() -> None:
    """The serving process runs the main process's generate from its own random state: a sampled
    generation draws other tokens there (the forwards stay as many: synced_gpus keeps them in
    step), so nothing but the served tokens can show it."""
    from shardwise.engine import lone

    _patch(lone, "_set_rng_state", lambda state, device: None)


@fault("lone_done_drops_journal", row="the main process's calls alone after `wait_for_everyone()`",
       test="tests/test_lone_calls.py::test_planted_lone_done_drops_journal_is_caught")
def _lone_done_drops_journal() -> None:
    """The main process ends its service ("done") without the EMA calls made since its last
    served call: the other process never replays the `restore`, so its shard keeps the EMA."""
    from shardwise.engine.lone import LoneCalls

    def send(self: Any, command: tuple[Any, ...]) -> None:
        if command[0] == "done":
            self.journal.clear()
        send.__wrapped__(self, command)  # type: ignore[attr-defined]

    _patch(LoneCalls, "_send", send)


# -- the code only a GPU runs, on CPU by the GPU's rules (tests/unit/test_unit_gpu_rules.py) ------
_GPU_RULES = "tests/unit/test_unit_gpu_rules.py::"


@fault("staged_on_the_gpu", row="asynchronous checkpoints on a GPU",
       test=_GPU_RULES + "test_planted_staged_on_the_gpu_is_caught")
def _staged_on_the_gpu() -> None:
    """The staged copy of a shard rebuilt with `DTensor.from_local`: it moves the host copy back
    to the mesh's device (a second GPU copy of every shard until the write ends)."""
    from torch.distributed.tensor import DTensor

    from shardwise.checkpoint import background

    _patch(background, "with_local", lambda local, like: DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()))


@fault("writer_on_gpu0", row="asynchronous checkpoints on a GPU",
       test=_GPU_RULES + "test_planted_writer_on_gpu0_is_caught")
def _writer_on_gpu0() -> None:
    """The writer thread never sets the training's device: it runs on GPU 0."""
    from shardwise.checkpoint.background import BackgroundWriter

    def run(self: Any, target: Any, job: Any) -> None:
        device, self.device = self.device, None
        try:
            run.__wrapped__(self, target, job)  # type: ignore[attr-defined]
        finally:
            self.device = device

    _patch(BackgroundWriter, "_run", run)


@fault("pinned_by_the_caching_allocator", row="asynchronous checkpoints on a GPU",
       test=_GPU_RULES + "test_planted_pinned_by_the_caching_allocator_is_caught")
def _pinned_by_the_caching_allocator() -> None:
    """Staging buffers from `torch.empty(..., pin_memory=True)`: the caching host allocator's
    blocks, each rounded up to a power of two."""
    import torch

    from shardwise.checkpoint import background

    _patch(background, "pinned", lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True))
    from shardwise.strategies import sharded_optim

    _patch(sharded_optim, "pinned", lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=True))


@fault("offloaded_state_to_gpu", row="offloaded state on a GPU",
       test=_GPU_RULES + "test_planted_offloaded_state_to_gpu_is_caught")
def _offloaded_state_to_gpu() -> None:
    """The offloaded optimizer's checkpoint state made with `DTensor.from_local`: its host
    shards copied to the GPU at every save and load (8 bytes a parameter over the world)."""
    from torch.distributed.tensor import DTensor

    from shardwise.strategies import sharded_optim

    _patch(sharded_optim, "with_local", lambda local, like: DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()))


@fault("state_cut_on_the_gpu", row="offloaded state on a GPU",
       test=_GPU_RULES + "test_planted_state_cut_on_the_gpu_is_caught")
def _state_cut_on_the_gpu() -> None:
    """An EMA shadow cut with `distribute_tensor(x.to(param.device), mesh)`: on the mesh's
    device (the GPU) while the offloaded parameter is on the host."""
    from torch.distributed.tensor import distribute_tensor

    from shardwise.weights import ema

    _patch(ema, "_like", lambda shadow, param: distribute_tensor(
        shadow.detach().to(param.device), param.device_mesh, param.placements, src_data_rank=None))


@fault("rng_of_every_gpu", row="a GPU's generator in a checkpoint",
       test=_GPU_RULES + "test_planted_rng_of_every_gpu_is_caught")
def _rng_of_every_gpu() -> None:
    """The checkpoint holds every visible GPU's generator and restores them all."""
    import torch

    from shardwise.checkpoint import sharded

    def state() -> dict[str, Any]:
        out = state.__wrapped__()  # type: ignore[attr-defined]
        out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def set_state(saved: dict[str, Any]) -> None:
        cuda = saved.pop("cuda", None)
        set_state.__wrapped__(saved)  # type: ignore[attr-defined]
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    _patch(sharded, "_rng_state", state)
    _patch(sharded, "_set_rng_state", set_state)


@fault("clock_before_sync", row="throughput on a GPU",
       test=_GPU_RULES + "test_planted_clock_before_sync_is_caught")
def _clock_before_sync() -> None:
    """The metrics record reads its clock before the GPU finished the interval's kernels."""
    from shardwise.runtime import metrics

    def record(self: Any, step: int, memory: Any, extra: dict[str, Any]) -> dict[str, Any]:
        metrics.time.perf_counter()  # the interval's end read as before: ahead of the device's sync
        return record.__wrapped__(self, step, memory, extra)  # type: ignore[attr-defined]

    _patch(metrics.Meter, "record", record)


@fault("backend_string_as_name", row="a group's backend read per device type",
       test="tests/test_gpu_groups.py::test_planted_backend_string_as_name_is_caught")
def _backend_string_as_name() -> None:
    """A group's backend taken as one name for every device type, as `dist.get_backend(g) ==
    "gloo"` took it: under "cpu:gloo,cuda:gloo" (a GPU run's "cpu:gloo,cuda:nccl") no branch on
    gloo is taken."""
    import torch.distributed as dist

    from shardwise.accelerate import extras, objects
    from shardwise.distributed import world
    from shardwise.strategies import fsdp

    def backends_of(group: Any = None) -> dict[str, str]:
        return dict.fromkeys(("cpu", "cuda"), str(dist.get_backend(group)))

    for module in (world, fsdp, extras, objects):
        _patch(module, "backends_of", backends_of)


@fault("host_tensors_on_nccl", row="the collective auditor",
       test="tests/test_gpu_groups.py::test_planted_host_tensors_on_nccl_is_caught")
def _host_tensors_on_nccl() -> None:
    """A pure-NCCL default group read as taking CPU tensors: a CPU run on it is not refused, and
    the engine's host-side collectives send CPU tensors on it (NCCL refuses them)."""
    from shardwise.distributed import world

    def backends_of(group: Any = None) -> dict[str, str]:
        return {"cpu": "gloo", **backends_of.__wrapped__(group)}  # type: ignore[attr-defined]

    _patch(world, "backends_of", backends_of)


@fault("stage_by_from_local", row="asynchronous checkpoints on a GPU",
       test=_GPU_RULES + "test_planted_stage_by_from_local_is_caught")
def _stage_by_from_local() -> None:
    """The source read as if the staging copy were rebuilt with `DTensor.from_local` again."""
    from pathlib import Path as _Path

    def read_text(self: _Path, *args: Any, **kwargs: Any) -> str:
        text: str = read_text.__wrapped__(self, *args, **kwargs)  # type: ignore[attr-defined]
        if self.as_posix().endswith("shardwise/checkpoint/background.py"):
            text += ("\n\ndef _stage(buf, t):\n"
                     "    out = DTensor.from_local(buf, t.device_mesh, t.placements)\n    return out\n")
        return text

    _patch(_Path, "read_text", read_text)


@fault("fp16_inputs_uncast", row="DeepSpeed's fp16 on a GPU",
       test="tests/test_deepspeed_precision.py::test_planted_fp16_inputs_uncast_is_caught")
def _fp16_inputs_uncast() -> None:
    """DeepSpeed's fp16 section without `auto_cast`: the weights cast, float inputs left fp32."""
    from shardwise.strategies.deepspeed import setup

    def keys(cfg: Any) -> dict[str, Any]:
        out: dict[str, Any] = keys.__wrapped__(cfg)  # type: ignore[attr-defined]
        if "fp16" in out:
            out["fp16"] = {k: v for k, v in out["fp16"].items() if k != "auto_cast"}
        return out

    _patch(setup, "_precision_keys", keys)


@fault("export_of_cast_weights", row="DeepSpeed's fp16 on a GPU",
       test="tests/test_deepspeed_precision.py::test_planted_export_of_cast_weights_is_caught")
def _export_of_cast_weights() -> None:
    """An export gathers the module's own (cast) weights, not the fp32 masters."""
    import torch

    from shardwise.strategies.deepspeed.strategy import DeepSpeedStrategy

    def full_state_dict(self: Any, model: Any) -> dict[str, Any]:
        module = self.unwrap(model)
        out = {}
        for name, p in module.named_parameters():
            with self.ds.zero.GatheredParameters([p], modifier_rank=None):
                out[name] = p.detach().to("cpu", copy=True)
        if not self.info.is_main:
            return {}
        return {n: out.get(n, t.detach().to("cpu", copy=True) if torch.is_tensor(t) else t)
                for n, t in module.state_dict(keep_vars=True).items()}

    _patch(DeepSpeedStrategy, "full_state_dict", full_state_dict)


@fault("hang_unwatched", row="a hung collective on a GPU",
       test="tests/test_resilience.py::test_planted_hang_unwatched_is_caught")
def _hang_unwatched() -> None:
    """No hang watch: a process blocked in the device waits until NCCL's watchdog (none on CPU)."""
    from shardwise.runtime import supervision

    class _Off:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def beat(self) -> None:
            pass

        def close(self) -> None:
            pass

    _patch(supervision, "HangWatch", _Off)


# -- the GPU session's verdict (test_benchmarks: benchmarks/gpu_session.sh's CPU dry run) ----------
@fault("gpu_session_stage_aliases", row="`benchmarks/gpu_session.sh` says pass or fail",
       test="tests/test_benchmarks.py::test_planted_gpu_session_stage_aliases_is_caught")
def _gpu_session_stage_aliases() -> None:
    """The regression of `async_stage_aliases` (an asynchronous save's staging hands the writer
    the live tensors, so a write overlapping the next step stores that step's weights), planted
    in every process the GPU session starts: its multi-process part must fail, and the session
    with it."""
    from shardwise.checkpoint import background

    _patch(background._Copier, "tensor", lambda self, t: t)


@fault("hang_watch_ignores_the_device", row="a hung collective on a GPU",
       test="tests/unit/test_unit_gpu_rules.py::test_planted_hang_watch_ignores_the_device_is_caught")
def _hang_watch_ignores_the_device() -> None:
    """The watch takes any lack of progress as a hang, the device's queue unread: a script's own
    long CPU work between steps would end the run."""
    from shardwise.runtime import hang

    _patch(hang, "device_busy", lambda device: True)


# -- transformers' Trainer on shardwise (tests/test_trainer.py: launched scripts) ----------------
TRAINER_ROW = "a transformers `Trainer` script, unchanged, under `shardwise launch --config`"


@fault("trainer_left_on_accelerate", row=TRAINER_ROW,
       test="tests/test_trainer.py::test_planted_trainer_faults_are_caught")
def _trainer_left_on_accelerate() -> None:
    """The regression the issue found: the launched Trainer builds Accelerate's own Accelerator
    (the import hooks do nothing: no install, no guard on Accelerate's class), so the config is
    silently ignored and DDP trains."""
    from shardwise.trainer import routes

    _patch(routes, "install", lambda **config: None)
    _patch(routes, "on_accelerate_import", lambda module: None)


@fault("trainer_accumulates_twice", row=TRAINER_ROW,
       test="tests/test_trainer.py::test_planted_trainer_faults_are_caught")
def _trainer_accumulates_twice() -> None:
    """The engine keeps the accumulation a DeepSpeed JSON's "auto" carried (the Trainer's 2) and
    divides the Trainer's already divided loss again."""
    from shardwise.trainer import methods

    _patch(methods, "own_accumulation", lambda acc, args: None)


@fault("trainer_resume_without_scheduler", row="a Trainer checkpoint resumed",
       test="tests/test_trainer.py::test_planted_trainer_faults_are_caught")
def _trainer_resume_without_scheduler() -> None:
    """A resume that restores the sharded state but not the Trainer's scheduler (its warmup
    starts again)."""
    from shardwise.trainer import methods

    def load(trainer: Any, original: Any, checkpoint: Any) -> None:
        if checkpoint is not None:
            trainer.accelerator.load_state(methods._checked(checkpoint))

    methods.REPLACED["_load_optimizer_and_scheduler"] = load


@fault("trainer_own_accelerator_allowed",
       row="a script's own `accelerate.Accelerator` under `shardwise launch`",
       test="tests/test_trainer.py::test_planted_trainer_faults_are_caught")
def _trainer_own_accelerator_allowed() -> None:
    """A script's own accelerate.Accelerator runs (Accelerate's engine, the config ignored)."""
    from shardwise.trainer import routes

    _patch(routes, "on_accelerate_import", lambda module: None)


@fault("trainer_adapters_merged", row="peft adapters under the Trainer",
       test="tests/test_trainer.py::test_planted_trainer_faults_are_caught")
def _trainer_adapters_merged() -> None:
    """`save_model` writes the merged model (base weights and adapters folded in) instead of the
    adapters peft loads."""
    from shardwise.trainer import methods

    def save_model(trainer: Any, original: Any, output_dir: Any = None,
                   _internal_call: bool = False) -> None:
        if not _internal_call:
            trainer.accelerator.save_model(trainer.model, output_dir or trainer.args.output_dir,
                                           merge_adapters=True)

    methods.REPLACED["save_model"] = save_model


@fault("trl_reference_left_whole", row="TRL's trainers, unchanged, under `shardwise launch --config`",
       test="tests/test_trainer_trl.py::test_planted_trl_reference_left_whole_is_caught")
def _trl_reference_left_whole() -> None:
    """A model prepared for evaluation only (`prepare_model(evaluation_mode=True)`: DPO's frozen
    reference) comes back as it was: whole on every rank, not sharded beside the policy."""
    from shardwise.accelerate.accelerator import Accelerator

    def prepare_model(self: Any, model: Any, device_placement: Any = None,
                      evaluation_mode: bool = False) -> Any:
        return model if evaluation_mode else self.prepare(model)

    _patch(Accelerator, "prepare_model", prepare_model)
