"""The `shardwise` command: launch, config, plan, export, verify, report, env, slurm-script.

Flags for the config tree are generated from its fields (their docstrings are the help), so the
command line, the YAML file and `Engine(...)` keywords always name the same settings. `plan` is
in `cli.plan`, `env` in `cli.env`; what a cluster scheduler gives `launch` is read by
`cli.scheduler`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import tempfile
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..config.batch import check_train_batch
from ..config.docs import field_docs
from ..config.files import build, load_layers, merge, read_file, to_yaml, write_yaml
from ..config.parallelism import DIMS
from ..config.tree import FLAT_KEYS, ConfigError, EngineConfig, LaunchConfig, ParallelismConfig
from .env import environment, run_env
from .plan import add_plan_parser, run_plan
from .scheduler import Scheduler, derive, detect, slurm_script

__all__ = ["build_parser", "entry", "environment", "main", "resolve"]

DEFAULT_CONFIG = "shardwise.yaml"
_UNSET: Any = object()
# Fields of EngineConfig that get a flag (nested sections and code-only fields do not).
_ENGINE_FLAGS = [
    "strategy", "backend", "precision", "offload", "shard_group_size", "grad_accum_steps", "max_grad_norm",
    "seed", "cpu",
    "wrap", "activation_checkpointing", "micro_batch_size", "train_batch_size", "checkpoint_dir",
    "offload_bucket_numel", "checkpoint_every_steps", "checkpoint_every_seconds", "keep_last",
    "collective_timeout_s", "hang_watch", "preempt_signals", "preempt_grace_s", "resume",
    "activation_checkpointing_every", "compile", "compile_backend", "compile_mode", "compile_fullgraph",
    "compile_dynamic", "checkpoint_async", "tensor_parallel_size", "sequence_parallel",
    "context_parallel_size", "context_parallel", "expert_parallel_size",
]
# torchrun's own flags that fill the launch section instead of passing through.
_TORCHRUN_FOLDED = {
    "nproc_per_node": "num_processes", "nnodes": "num_nodes", "node_rank": "node_rank",
    "max_restarts": "max_restarts", "rdzv_backend": "rdzv_backend", "rdzv_id": "rdzv_id",
    "master_addr": "main_address", "master_port": "main_port",
}


def _whole_number(text: str) -> int | str:
    if text in ("auto", "node"):  # the words a whole-number setting may take (the config checks which)
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (e.g. 2)") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 1.0)") from None


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag value reported in one line (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _flag_type(tp: Any) -> dict[str, Any]:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if tp is bool or args == [bool]:
        return {"action": argparse.BooleanOptionalAction}
    literals = [x for a in [tp, *args] for x in typing.get_args(a) if typing.get_origin(a) is typing.Literal]
    if literals and all(isinstance(x, str) for x in literals) and bool in args:
        # a choice that a bool also names (activation_checkpointing): --<flag>/--no-<flag> as when the
        # setting was a bool (a value after it would swallow the script's name), --<flag>-mode MODE
        return {"action": argparse.BooleanOptionalAction, "modes": list(literals)}
    if literals and all(isinstance(x, str) for x in literals) and typing.get_origin(tp) is typing.Literal:
        return {"choices": list(literals)}
    if int in args or tp is int:
        return {"type": _whole_number}
    if float in args or tp is float:
        return {"type": _number}
    if typing.get_origin(tp) is tuple:
        return {"nargs": "+"}
    return {"type": str}


def _add_config_flags(parser: argparse.ArgumentParser, *, skip: frozenset[str] = frozenset()) -> None:
    group = parser.add_argument_group("config (override the file)")
    group.add_argument("--config", default=None,
                       help=f"shardwise YAML, or a DeepSpeed JSON (default: ./{DEFAULT_CONFIG} if present)")
    group.add_argument("--deepspeed", dest="deepspeed_config", default=_UNSET,
                       help="a DeepSpeed JSON to translate")
    # the flat keys by their own names (their section's field gives the type and help), the launch
    # section's by theirs, the mesh sizes by their section's name (--parallelism-tp 2)
    flat = [(FLAT_KEYS[key][1], key, EngineConfig.section_type(FLAT_KEYS[key][0])) for key in _ENGINE_FLAGS]
    named: list[tuple[str, str, type]] = [(f.name, f"launch.{f.name}", LaunchConfig)
                                          for f in dataclasses.fields(LaunchConfig)]
    named += [(d, f"parallelism.{d}", ParallelismConfig) for d in DIMS]
    for name, dest, cls in [*flat, *named]:
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        flag = "--" + (dest.replace(".", "_") if dest.startswith("parallelism.") else dest.split(".")[-1])
        flag = flag.replace("_", "-")
        if flag in skip:
            continue
        kind = _flag_type(hints[name])
        modes = kind.pop("modes", None)
        group.add_argument(flag, dest=dest, default=_UNSET, help=docs.get(name, ""), **kind)
        if modes:
            group.add_argument(flag + "-mode", dest=dest, default=_UNSET, choices=modes,
                               help=f"{name} by name ({flag}: {modes[1]}, --no-{flag[2:]}: {modes[0]})")


def _flag_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The config values given as flags, as a nested settings dict."""
    out: dict[str, Any] = {}
    for dest, value in vars(ns).items():
        if value is _UNSET or dest in ("config", "command", "action") or dest.startswith("_"):
            continue
        if dest.startswith(("launch.", "parallelism.")):
            section, key = dest.split(".", 1)
            out.setdefault(section, {})[key] = value
        elif dest in _ENGINE_FLAGS or dest == "deepspeed_config":
            out[dest] = value
    return out


def _config_path(ns: argparse.Namespace) -> str | None:
    if ns.config:
        return str(ns.config)
    return DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else None


def resolve(ns: argparse.Namespace, extra: dict[str, Any] | None = None) -> tuple[EngineConfig, list[str]]:
    """Defaults < DeepSpeed JSON < config file < flags; validated."""
    path = _config_path(ns)
    flags = merge(_flag_settings(ns), extra or {})
    data, dropped, spelled = load_layers(path, flags)
    return build(data, path or "flags", spelled), dropped


# -- launch -----------------------------------------------------------------------------------
def _actions_of(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every flag and positional of a parser that torch built (torchrun's).

    argparse keeps them in `ArgumentParser._actions` and has no public accessor (checked against
    Python 3.11 to 3.13); this is the one place shardwise reads it. Our own parsers keep the
    references argparse returns instead."""
    return list(parser._actions)


def _launch_parser(sub: Any) -> list[argparse.Action]:
    """The `launch` subcommand: torchrun's flags, then our config flags; torchrun's actions."""
    from torch.distributed.run import get_args_parser

    torchrun = get_args_parser()
    actions = _actions_of(torchrun)
    p = sub.add_parser(
        "launch",
        help="run a training script on every process (torchrun underneath)",
        description="Run SCRIPT on every process through torchrun; every torchrun flag is accepted.",
        parents=[torchrun],
        conflict_handler="resolve",
        add_help=False,
    )
    p.set_defaults(**{a.dest: _UNSET for a in actions if a.option_strings and a.dest != "help"})
    taken = frozenset(s for a in actions for s in a.option_strings)
    _add_config_flags(p, skip=taken)
    return actions


def _torchrun_extra(ns: argparse.Namespace, torchrun: list[argparse.Action]) -> list[str]:
    """torchrun flags the user gave that do not fill the launch section, passed on as given."""
    extra: list[str] = []

    def spelled(action: argparse.Action) -> str:
        return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])

    for action in torchrun:
        if not action.option_strings or action.dest in _TORCHRUN_FOLDED or action.dest == "standalone":
            continue
        value = getattr(ns, action.dest, _UNSET)
        if value is _UNSET or action.dest in ("config", "deepspeed_config") or action.dest in _ENGINE_FLAGS:
            continue
        if action.dest.startswith("launch."):
            continue
        if action.nargs == 0:
            if value:
                extra.append(spelled(action))
        elif isinstance(value, list):
            for v in value:
                extra += [spelled(action), str(v)]
        else:
            extra += [spelled(action), str(value)]
    return extra


def _scheduler_settings(ns: argparse.Namespace,
                        folded: dict[str, Any]) -> tuple[Scheduler | None, dict[str, Any]]:
    """The cluster scheduler this launch runs under (None: none), and the launch settings it gives
    that neither a flag nor the config file gives (those win)."""
    scheduler = detect(os.environ)
    if scheduler is None:
        return None, {}
    path = _config_path(ns)
    from_file = load_layers(path).data.get("launch", {}) if path else {}
    explicit = {**(from_file if isinstance(from_file, dict) else {}),
                **_flag_settings(ns).get("launch", {}), **folded}
    return scheduler, derive(scheduler, explicit)


def _cmd_launch(ns: argparse.Namespace, torchrun: list[argparse.Action]) -> int:
    from .launch import RUNNER, requeue_slurm, run_torchrun, torchrun_argv

    folded: dict[str, Any] = {}
    for dest, field in _TORCHRUN_FOLDED.items():
        value = getattr(ns, dest, _UNSET)
        if value is _UNSET:
            continue
        if field in ("num_processes", "num_nodes", "node_rank", "max_restarts", "main_port"):
            try:
                value = int(value)
            except ValueError:
                flag = "--" + dest.replace("_", "-")
                raise ConfigError(f"{flag}={value!r}: shardwise launch needs a number") from None
        folded[field] = value
    if getattr(ns, "standalone", _UNSET) is True:
        folded["num_nodes"] = 1
    scheduler, derived = _scheduler_settings(ns, folded)
    launch = {**derived, **folded}
    cfg, dropped = resolve(ns, {"launch": launch} if launch else None)
    if dropped:
        print(f"shardwise: the DeepSpeed config's {', '.join(dropped)} have no effect here", file=sys.stderr)
    script = ns.training_script
    module_mode = getattr(ns, "module", _UNSET) is True or getattr(ns, "no_python", _UNSET) is True
    if script is _UNSET or script is None:
        raise ConfigError("no training script given: shardwise launch [options] SCRIPT [args]")
    if not module_mode and not Path(script).is_file():
        raise ConfigError(f"training script {script!r} not found")
    if isinstance(cfg.training.micro_batch_size, int):
        check_train_batch(cfg, cfg.training.micro_batch_size, cfg.launch.num_processes * cfg.launch.num_nodes)
    argv = torchrun_argv(cfg.launch, script, ns.training_script_args or [], _torchrun_extra(ns, torchrun),
                         runner=None if module_mode else RUNNER)
    after_save = None
    if scheduler is not None:
        print(f"shardwise launch: {scheduler.describe(derived)}; running torchrun {' '.join(argv)}",
              file=sys.stderr, flush=True)
        job = scheduler.requeue_id
        if job and cfg.launch.node_rank == 0:  # one requeue per job: node 0's launcher asks for it
            after_save = functools.partial(requeue_slurm, job)
    fd, path = tempfile.mkstemp(prefix="shardwise-", suffix=".yaml")
    os.close(fd)
    try:
        source = _config_path(ns)
        write_yaml(cfg, path, header=f"# resolved by shardwise launch from {source or 'its flags'}\n")
        # stopped, the workers get up to preempt_grace_s to reach a boundary, then their save's
        # collectives time out after collective_timeout_s: the launcher waits that long for them
        sup = cfg.supervision
        return run_torchrun(argv, path, stop_signal=(sup.preempt_signals or ("SIGTERM",))[0],
                            stop_timeout_s=sup.preempt_grace_s + sup.collective_timeout_s,
                            **({"after_save": after_save} if after_save else {}))
    finally:
        Path(path).unlink(missing_ok=True)


# -- config -----------------------------------------------------------------------------------
_QUESTIONS = [
    ("sharding.strategy", "Sharding strategy (ddp, zero1, zero2, zero3, auto)"),
    ("sharding.precision", "Precision (fp32, bf16, fp16)"),
    ("sharding.offload", "Offload to host memory (none, optimizer, params)"),
    ("training.grad_accum_steps", "Gradient accumulation steps"),
    ("training.max_grad_norm", "Clip gradients to this norm (empty: no clipping)"),
    ("blocks.activation_checkpointing",
     "Activation checkpointing (none, full, selective, offload; yes = full)"),
    ("launch.num_processes", "Processes per machine (one per GPU)"),
    ("launch.num_nodes", "Number of machines"),
]


def _ask(defaults: EngineConfig) -> dict[str, Any]:
    """The questionnaire: each answer is checked at once and asked again if refused."""
    answers: dict[str, Any] = {}
    questions = list(_QUESTIONS)
    while questions:
        key, text = questions.pop(0)
        node: Any = defaults
        for part in key.split("."):
            node = getattr(node, part)
        shown = "" if node is None else ("yes" if node is True else "no" if node is False else node)
        try:
            raw = input(f"{text} [{shown}]: ").strip()
        except EOFError:
            raise ConfigError("the questionnaire ended before every question was answered") from None
        if raw == "":
            continue
        value: Any = raw
        if raw.lower() in ("yes", "y", "true", "no", "n", "false"):
            value = raw.lower() in ("yes", "y", "true")
        elif raw.lstrip("-").isdigit():
            value = int(raw)
        else:
            with contextlib.suppress(ValueError):
                value = float(raw)
        trial = merge(answers, _nested(key, value))
        try:
            build(trial, "answer")
        except ConfigError as err:
            print(f"  {str(err).removeprefix('answer: ')}")
            questions.insert(0, (key, text))
            continue
        answers = trial
        if key == "blocks.activation_checkpointing" and value == "selective":
            questions.insert(0, ("blocks.activation_checkpointing_every",
                                 "Checkpoint every k-th block in full instead (empty: keep matmul outputs)"))
        if key == "launch.num_nodes" and value != 1:
            questions += [("launch.node_rank", "This machine's rank (0 hosts the rendezvous)"),
                          ("launch.main_address", "Address of machine 0"),
                          ("launch.main_port", "Port on machine 0")]
    return answers


def _nested(key: str, value: Any) -> dict[str, Any]:
    head, _, rest = key.partition(".")
    return {head: _nested(rest, value) if rest else value}


def _cmd_config(ns: argparse.Namespace) -> int:
    if ns.action == "show":
        cfg, dropped = resolve(ns)
        print(to_yaml(cfg), end="")
        if dropped:
            print(f"# no effect here: {', '.join(dropped)}")
        return 0
    out = Path(ns.output)
    if out.exists() and not ns.force:
        raise ConfigError(f"{out} exists; pass --force to overwrite it, or --output another file")
    header = ""
    if ns.from_accelerate:
        from ..config.translate import from_accelerate

        here = Path(ns.from_accelerate).parent
        settings, dropped = from_accelerate(
            read_file(ns.from_accelerate),
            source=ns.from_accelerate,
            read_json=lambda p: read_file(here / p if not Path(p).is_absolute() else p),
        )
        cfg = build(merge(settings, _flag_settings(ns)), ns.from_accelerate)
        header = f"# translated from {ns.from_accelerate} by shardwise config --from-accelerate\n"
        if dropped:
            header += "".join(f"# dropped: {d}\n" for d in dropped)
            print("dropped (no equivalent in shardwise):\n" + "".join(f"  {d}\n" for d in dropped), end="")
    elif _flag_settings(ns) or ns.defaults or ns.config:
        cfg, _ = resolve(ns)
    else:
        print("Answer each question, or press Enter for the value in brackets.")
        cfg = build(_ask(EngineConfig()), "answers")
    write_yaml(cfg, out, header=header)
    print(f"wrote {out}")
    return 0


# -- export -----------------------------------------------------------------------------------
def _cmd_export(ns: argparse.Namespace) -> int:
    """A training checkpoint -> the safetensors layout `Engine.save_model` writes (offline)."""
    from ..checkpoint.sharded import full_model_state, resolve
    from ..weights.export import drop_aliases, parse_size, write_safetensors

    out = Path(ns.output)
    if os.path.lexists(out) and not out.is_dir():
        raise ConfigError(
            f"{out}: is a file, not a folder; export writes a folder of files: choose another path"
        )
    try:
        limit = parse_size(ns.max_shard_size)
    except ValueError as err:
        raise ConfigError(f"--max-shard-size: {err}") from None
    folder = resolve(Path(ns.checkpoint))
    state, meta = full_model_state(folder, ns.model_index)
    config = folder / f"model{ns.model_index}.config.json"
    state = drop_aliases(state, meta["models"][ns.model_index]["aliases"])
    config_json = config.read_text() if config.is_file() else None
    write_safetensors(state, out, max_shard_size=limit, config_json=config_json)
    print(f"wrote {out} ({sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters from {folder})")
    return 0


def _cmd_verify(ns: argparse.Namespace) -> int:
    """Every file against its recorded checksum: exit 0 when all match, 2 (one line) otherwise."""
    from ..checkpoint.sharded import verify

    checked = verify(Path(ns.path))
    print(f"{ns.path}: {len(checked)} file(s) match their recorded checksums")
    return 0


# -- entry ------------------------------------------------------------------------------------
def _build() -> tuple[argparse.ArgumentParser, list[argparse.Action]]:
    """The `shardwise` parser, and torchrun's actions (the flags `launch` passes on)."""
    parser = _Parser(prog="shardwise", description="Sharded PyTorch training: launch, configure, inspect.")
    sub = parser.add_subparsers(dest="command", required=True)
    torchrun = _launch_parser(sub)
    cfg = sub.add_parser("config", help="write shardwise.yaml (questionnaire, flags, or from Accelerate); "
                                        "`config show` prints the resolved config")
    cfg.add_argument("action", nargs="?", choices=["show"], help="show: print the resolved config")
    cfg.add_argument("--output", "-o", default=DEFAULT_CONFIG, help="file to write (default: shardwise.yaml)")
    cfg.add_argument("--force", action="store_true", help="overwrite an existing file")
    cfg.add_argument("--defaults", action="store_true", help="write the defaults without asking")
    cfg.add_argument("--from-accelerate", metavar="YAML", help="translate an Accelerate config file")
    _add_config_flags(cfg)
    exp = sub.add_parser("export",
                         help="a training checkpoint -> safetensors (+ config.json), offline, one process")
    exp.add_argument("checkpoint", help="a checkpoint folder, or a folder holding `latest`")
    exp.add_argument("output",
                     help="the folder to write into (its other files stay; an earlier export is replaced)")
    exp.add_argument("--model-index", type=int, default=0, help="which prepared model (default 0)")
    exp.add_argument("--max-shard-size", default="5GB", help="split into several files above this size")
    ver = sub.add_parser("verify", help="check a checkpoint or an exported model against the checksums "
                                        "recorded at save")
    ver.add_argument("path", help="a checkpoint folder (or one holding `latest`), "
                                  "or a folder written by save_model/export")
    add_plan_parser(sub)
    rep = sub.add_parser("report",
                         help="plot a run's metrics.jsonl (loss, tokens/s, MFU, memory) into report.png")
    rep.add_argument("run_dir",
                     help="the folder a log_with='jsonl' run wrote (<project_dir>/logs/<run name>)")
    sub.add_parser("env", help="versions, devices and backends, and the cluster scheduler detected, "
                               "for a bug report")
    _slurm_parser(sub)
    return parser, torchrun


def _slurm_parser(sub: Any) -> None:
    p = sub.add_parser("slurm-script",
                       help="print an sbatch script that runs SCRIPT under shardwise launch, warned before "
                            "the time limit and requeued after a preempted stop")
    p.add_argument("script", nargs="?", default="train.py", help="the training script (default train.py)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.add_argument("--nodes", type=int, default=2, help="nodes (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8; 0: CPU processes)")
    p.add_argument("--cpus-per-task", type=int, default=None,
                   help="CPUs per node's task (on CPU: the processes per node; default 2 there)")
    p.add_argument("--time", default="24:00:00", help="the time limit (default 24:00:00)")
    p.add_argument("--job-name", default="shardwise", help="the job's name (default shardwise)")
    p.add_argument("--config", default=None,
                   help=f"the config file the launch reads (default: ./{DEFAULT_CONFIG} if present)")
    p.add_argument("--signal-lead-s", type=int, default=120,
                   help="seconds before the time limit that SIGTERM comes (default 120): one step, one "
                        "save and a margin")


def _cmd_slurm_script(ns: argparse.Namespace) -> int:
    print(slurm_script(ns.script, ns.script_args, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node,
                       cpus_per_task=ns.cpus_per_task, time=ns.time, job_name=ns.job_name,
                       signal_lead_s=ns.signal_lead_s, config=ns.config), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `shardwise` command's parser (every subcommand and flag)."""
    return _build()[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `shardwise` command on `argv` (default: the process's); the exit status."""
    parser, torchrun = _build()
    ns = parser.parse_args(argv)
    try:
        if ns.command == "launch":
            return _cmd_launch(ns, torchrun)
        if ns.command == "config":
            return _cmd_config(ns)
        if ns.command == "export":
            return _cmd_export(ns)
        if ns.command == "plan":
            return run_plan(ns)
        if ns.command == "verify":
            return _cmd_verify(ns)
        if ns.command == "slurm-script":
            return _cmd_slurm_script(ns)
        if ns.command == "report":
            from ..runtime.report import report

            png, text = report(Path(ns.run_dir))
            print(text)
            print(f"wrote {png}")
            return 0
        return run_env(ns)
    except (ConfigError, _checkpoint_error()) as err:
        print(f"shardwise: error: {err}", file=sys.stderr)
        return 2


def _checkpoint_error() -> type[Exception]:
    from ..checkpoint.sharded import CheckpointError

    return CheckpointError


def entry() -> None:
    """The console script `shardwise`."""
    from .launch import ignore_stop_signals

    code = main()
    ignore_stop_signals()  # the status is decided: a repeated SIGTERM during the exit must not change it
    sys.exit(code)
