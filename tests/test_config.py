"""The config tree, its files, the foreign formats and the CLI, in one process (no workers)."""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from planted import caught, planted_here

import shardwise
from shardwise import cli
from shardwise.config import EngineConfig
from shardwise.config.files import load_config
from shardwise.config.tree import ConfigError, ParallelismConfig, ShardingConfig

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures"
GOLDEN = HERE / "golden"
UPDATE = os.environ.get("SHARDWISE_UPDATE_GOLDEN") == "1"


def _golden(name: str, text: str, update: bool = UPDATE) -> None:
    path = GOLDEN / name
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    expected = path.read_text()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "now"))
    assert text == expected, f"{name} changed (SHARDWISE_UPDATE_GOLDEN=1 to accept):\n{diff}"


@pytest.mark.parametrize("name", sorted(p.name for p in (FIXTURES / "accelerate").glob("*.yaml")))
def test_accelerate_yaml_translates_to_golden(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_translation(name, tmp_path, monkeypatch)


def check_translation(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      update: bool = UPDATE) -> None:
    monkeypatch.chdir(FIXTURES / "accelerate")
    out = tmp_path / "shardwise.yaml"
    assert cli.main(["config", "--from-accelerate", name, "--output", str(out)]) == 0
    _golden(f"accelerate/{name}", out.read_text(), update)
    load_config(out)  # what it wrote loads back as a valid config


def test_a_mistranslated_key_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with planted_here("reshard_after_forward_ignored"):  # (never writes the golden file)
        caught(check_translation, "fsdp2_zero2_size_wrap.yaml", tmp_path, monkeypatch, update=False,
               must=r"(?s)^accelerate/fsdp2_zero2_size_wrap\.yaml changed .*"
                    r"-  strategy: zero2\n *\+  strategy: zero3")


def test_issue_example_becomes_zero3_on_two_processes_fp32() -> None:
    cfg = load_config(GOLDEN / "accelerate" / "fsdp1_numeric.yaml")
    assert (cfg.sharding.strategy, cfg.launch.num_processes, cfg.sharding.precision) == ("zero3", 2, "fp32")


@pytest.mark.parametrize("name", ["tutorial_zero2.json", "tutorial_zero3_offload.json"])
def test_deepspeed_json_translates_to_golden(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(FIXTURES / "deepspeed")
    assert cli.main(["config", "show", "--config", name]) == 0
    _golden(f"deepspeed/{name}.yaml", capsys.readouterr().out)


def test_deepspeed_translation_details() -> None:
    z2 = load_config(FIXTURES / "deepspeed" / "tutorial_zero2.json")
    assert (z2.strategy, z2.offload, z2.precision, z2.max_grad_norm) == ("zero2", "none", "fp16", 1.0)
    scale = z2.loss_scale
    assert scale.init_scale == 2**15 and scale.hysteresis == 2 and scale.growth_interval == 1000
    assert z2.optimizer is not None and z2.optimizer.lr == "auto" and z2.scheduler.type == "WarmupDecayLR"
    z3 = load_config(FIXTURES / "deepspeed" / "tutorial_zero3_offload.json")
    assert (z3.strategy, z3.offload) == ("zero3", "params")


BAD = {
    "unknown_key.yaml": "unknown key 'stratgy' (did you mean 'strategy'?)",
    "unknown_nested_key.yaml": "unknown key 'launch.num_process' (did you mean 'num_processes'?)",
    "bad_strategy.yaml": "strategy: expected 'ddp', 'zero1', 'zero2', 'zero3' or 'auto', found 'zero4'",
    "wrong_type_int.yaml": "grad_accum_steps: expected a valid integer",
    "wrong_type_bool.yaml": "cpu: expected a valid boolean",
    "yaml_syntax.yaml": "yaml_syntax.yaml:3: YAML syntax error",
    "json_syntax.json": "json_syntax.json:3: JSON syntax error",
    "top_level_list.yaml": "expected a mapping of settings at the top, found list",
    "offload_params_below_zero3.yaml": "offload='params' needs strategy='zero3'",
    "node_rank_out_of_range.yaml": "launch.node_rank=2 must lie in 0..1",
    "ds_bad_stage.json": "zero_optimization.stage: expected 0, 1, 2 or 3, found 4",
    "ds_nvme.json": "'nvme' offload is not supported",
    "ds_batch_mismatch.json": (
        "train_batch_size=10 but micro_batch_size 2 x grad_accum_steps 1 x 2 processes = 4"
    ),
    "ds_unknown_optimizer.json": "'Lamb' is not supported; choose one of: AdamW, Adam, SGD",
    "zero_accumulation.yaml": "grad_accum_steps=0 must be an integer >= 1",
    "precision_not_a_name.yaml": "precision: expected 'fp32', 'bf16' or 'fp16', found 16",
    "missing_deepspeed_file.yaml": "not_there.json: no such config file",
    "scheduler_without_optimizer.yaml": "scheduler needs an optimizer section",
    "port_not_a_number.yaml": "launch.main_port: expected a valid integer",
    "negative_clipping.yaml": "max_grad_norm=-1.0 must be a number >= 1e-12",
    "optimizer_lr_word.yaml": "optimizer.lr: expected a valid number",
    "not_utf8.yaml": "not_utf8.yaml: is not UTF-8 text (byte 21 is 0xe9); save it as UTF-8",
    "ds_not_utf8.json": "ds_not_utf8.json: is not UTF-8 text (byte 53 is 0xe9); save it as UTF-8",
}


@pytest.fixture()
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> list:
    started: list = []
    monkeypatch.setattr("shardwise.cli.launch.run_torchrun",
                        lambda argv, path, **_: started.append(argv) or 0)
    return started


def test_every_bad_fixture_is_covered() -> None:
    assert sorted(BAD) == sorted(p.name for p in (FIXTURES / "bad").iterdir())
    assert len(BAD) >= 15


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_config_is_refused_before_start(
    name: str, no_torchrun: list, capsys: pytest.CaptureFixture[str]
) -> None:
    check_refused(name, no_torchrun, capsys)


def check_refused(name: str, no_torchrun: list, capsys: pytest.CaptureFixture[str]) -> None:
    script = HERE / "scripts" / "train_from_config.py"
    code = cli.main(
        ["launch", "--config", str(FIXTURES / "bad" / name), "--nproc-per-node", "2", str(script)]
    )
    err = capsys.readouterr().err
    assert code == 2 and not no_torchrun, \
        f"{name}: launch exited {code}, not 2, and started torchrun {len(no_torchrun)} time(s)"
    assert err.count("\n") == 1 and err.startswith("shardwise: error: "), err
    assert BAD[name] in err, err


def test_a_config_check_left_out_is_caught(no_torchrun: list, capsys: pytest.CaptureFixture[str]) -> None:
    with planted_here("loop_checks_skipped"):
        caught(check_refused, "zero_accumulation.yaml", no_torchrun, capsys,
               must=r"^zero_accumulation\.yaml: launch exited 0, not 2, and started torchrun 1 time")
    no_torchrun.clear()  # (the planted launch went through)
    check_refused("zero_accumulation.yaml", no_torchrun, capsys)  # undone: refused again


def check_one_tree() -> None:
    """The sections are the source; a flat key is another spelling of one field."""
    # resolved files written before the sections (flat keys) load as their sectioned goldens
    for old in sorted((HERE / "fixtures" / "flat").glob("*.yaml")):
        new = GOLDEN / old.name.replace("_", "/", 1)
        assert load_config(old) == load_config(new), f"{old.name} loads unlike {new}"
    nested = EngineConfig.of(sharding={"strategy": "zero3"}, parallelism={"tp": 2}, training={"seed": 3})
    flat = EngineConfig.of(strategy="zero3", tensor_parallel_size=2, seed=3)
    assert nested == flat  # one tree, whichever spelling filled it
    assert (flat.strategy, flat.tensor_parallel_size, flat.seed) == ("zero3", 2, 3)  # flat reads: the fields
    assert flat.with_keys(tensor_parallel_size=4).parallelism.tp == 4 and flat.parallelism.tp == 2
    # a setting given both ways agrees, or the config is refused in one line naming both
    assert EngineConfig.of(parallelism={"tp": 2}, tensor_parallel_size=2).parallelism.tp == 2
    with pytest.raises(ConfigError, match=r"parallelism.tp=2 and tensor_parallel_size=4 disagree"):
        EngineConfig.of(parallelism={"tp": 2}, tensor_parallel_size=4)
    with pytest.raises(ConfigError, match=r"parallelism.tp=2 and tensor_parallel_size=1 disagree"):
        EngineConfig.of(parallelism={"tp": 2}, tensor_parallel_size=1)  # (a default written is written)
    with pytest.raises(ConfigError, match=r"unknown setting 'stratgy' \(did you mean 'strategy'\?\)"):
        EngineConfig.of(stratgy="zero3")
    with pytest.raises(AttributeError):  # a flat read is read-only: the section holds the value
        flat.strategy = "ddp"
    with pytest.raises(ConfigError, match=r"strategy='zero4'"):  # a section checks its fields when made
        ShardingConfig(strategy="zero4")  # type: ignore[arg-type]


def test_the_sections_are_the_source_and_flat_keys_another_spelling() -> None:
    check_one_tree()


def test_a_flat_key_overriding_its_section_is_caught() -> None:
    with planted_here("flat_key_overrides_section"):
        caught(check_one_tree, must=r"DID NOT RAISE .*ConfigError")  # tp=2 against tensor_parallel_size=4
    check_one_tree()  # undone: the disagreement is refused again


# (a setting written in both spellings, one of them at its default; what the refusal says)
BOTH_WRITTEN = [
    ({"parallelism": {"cp": 1}, "context_parallel_size": 2}, "parallelism.cp=1 and context_parallel_size=2"),
    ({"training": {"grad_accum_steps": 1}, "grad_accum_steps": 4},
     "training.grad_accum_steps=1 and grad_accum_steps=4"),
    ({"parallelism": {"cp": 2, "cp_method": "ring"}, "context_parallel": "ulysses"},
     "parallelism.cp_method='ring' and context_parallel='ulysses'"),
    ({"parallelism": {"tp": 1}, "tensor_parallel_size": 2}, "parallelism.tp=1 and tensor_parallel_size=2"),
    ({"parallelism": {"tp": 2}, "tensor_parallel_size": 1}, "parallelism.tp=2 and tensor_parallel_size=1"),
]
# (a setting written in one spelling, the other's field only implied; the field it runs with)
IMPLIED = [
    ({"tensor_parallel_size": 2}, "parallelism", "tp", 2),
    ({"parallelism": {"tp": 2}}, "parallelism", "tp", 2),
    ({"parallelism": {"dp_replicate": 2}, "tensor_parallel_size": 2}, "parallelism", "tp", 2),
    ({"parallelism": {"cp": 2}, "context_parallel": "ulysses"}, "parallelism", "cp_method", "ulysses"),
    ({"parallelism": {"cp_method": "ulysses"}, "context_parallel_size": 2}, "parallelism", "cp", 2),
    ({"training": {"seed": 3}, "grad_accum_steps": 4}, "training", "grad_accum_steps", 4),
    ({"parallelism": {"tp": 1}, "tensor_parallel_size": 1}, "parallelism", "tp", 1),  # (written alike)
]


def _refusal(what: str, field: str, make: Callable[[], object]) -> str:
    """The one-line refusal `make` raises; a config (or Engine) it let through fails, naming the
    value `field` (`parallelism.cp`) ran with."""
    try:
        made = make()
    except ConfigError as err:
        assert "\n" not in str(err), str(err)
        return str(err)
    section, name = field.split(".")
    cfg = made if isinstance(made, EngineConfig) else getattr(made, "config", None)
    ran = getattr(getattr(cfg, section), name) if cfg is not None else made
    raise AssertionError(f"{what} was not refused: it runs with {field}={ran!r}")


def check_both_spellings_agree(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A setting written in both spellings must agree, a default included, or it is refused in
    one line naming both: in a file (`load_config`, `shardwise config show`), in `EngineConfig.of`
    and in `Engine(...)`'s keywords. A field only implied (not written) yields to the spelling
    that wrote it."""
    import yaml

    for i, (data, want) in enumerate(BOTH_WRITTEN):
        path = folder / f"both{i}.yaml"
        path.write_text(yaml.safe_dump(data))
        field = want.split("=")[0]
        said = [_refusal(f"a file of {data}", field, partial(load_config, path)),
                _refusal(f"EngineConfig.of(**{data})", field, partial(EngineConfig.of, **data)),
                _refusal(f"Engine(**{data})", field, partial(shardwise.Engine, cpu=True, **data))]
        for message in said:
            assert f"{want} disagree; set one of them" in message, (data, message)
        assert cli.main(["config", "show", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{want} disagree" in err, err
    for i, (data, section, name, value) in enumerate(IMPLIED):
        path = folder / f"implied{i}.yaml"
        path.write_text(yaml.safe_dump(data))
        for cfg in (load_config(path), EngineConfig.of(**data)):
            got = getattr(getattr(cfg, section), name)
            assert got == value, f"{data}: {section}.{name}={got!r}, not the written {value!r}"
    # a section given as its object: a field at its default cannot be told from an unwritten one
    cfg = EngineConfig.of(parallelism=ParallelismConfig(dp_shard=2), strategy="zero3", tensor_parallel_size=2)
    assert (cfg.parallelism.dp_shard, cfg.parallelism.tp) == (2, 2)


def test_a_setting_written_both_ways_agrees_even_at_its_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    check_both_spellings_agree(tmp_path, capsys)


def test_a_section_value_always_winning_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with planted_here("section_value_always_wins"):
        message = caught(check_both_spellings_agree, tmp_path, capsys,
                         must=r"^a file of \{'parallelism': \{'cp': 1\}, 'context_parallel_size': 2\} "
                              r"was not refused: it runs with parallelism\.cp=1")
    assert "was not refused: it runs with parallelism.cp=1" in message, message
    check_both_spellings_agree(tmp_path, capsys)  # undone: refused again


# (a setting, as a file or `Engine(...)` spells it; what the refusal must begin with)
AS_WRITTEN = [
    ({"checkpointing": {"every_steps": 0}}, "checkpointing.every_steps=0 must be an integer >= 1"),
    ({"checkpoint_every_steps": 0}, "checkpoint_every_steps=0 must be an integer >= 1"),
    ({"training": {"grad_accum_steps": 0}}, "training.grad_accum_steps=0 must be an integer >= 1"),
    ({"training": {"cpu": "maybe"}}, "training.cpu: expected a valid boolean"),
    ({"cpu": "maybe"}, "cpu: expected a valid boolean"),
    ({"sharding": {"strategy": "zero4"}}, "sharding.strategy"),
    ({"strategy": "zero4"}, "strategy"),
    ({"parallelism": {"tp": 0}}, "parallelism.tp=0 must be an integer >= 1"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be an integer >= 1"),
    ({"launch": {"nnodes": 2}}, "unknown key 'launch.nnodes' (did you mean 'num_nodes'?)"),
]


def check_refusals_as_written(folder: Path) -> None:
    """Each refusal names the setting as it was written: a file's (after the file's name) and
    `EngineConfig.of`'s keywords (`Engine(...)`'s; no type coercion there, so only the name)."""
    import yaml

    for i, (data, want) in enumerate(AS_WRITTEN):
        path = folder / f"bad{i}.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert str(err.value).startswith(f"{path}: {want}"), (data, str(err.value))
        with pytest.raises(ConfigError) as err:
            EngineConfig.of(**data)
        name, said = want.split(":")[0].split("=")[0], str(err.value)
        after = said[len(name):len(name) + 1]
        assert said.startswith(name) and not (after.isalnum() or after in "._"), (data, said)


def test_a_refusal_names_the_setting_as_it_was_written(tmp_path: Path) -> None:
    check_refusals_as_written(tmp_path)


def test_a_refusal_naming_the_other_spelling_is_caught(tmp_path: Path) -> None:
    with planted_here("refusal_names_one_spelling"):
        caught(check_refusals_as_written, tmp_path,
               must=r"^\(\{'checkpointing': \{'every_steps': 0\}\}, '[^']*: checkpoint_every_steps=0 must be")


def test_missing_script_is_named(no_torchrun: list, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["launch", "--nproc-per-node", "2", "nope.py"]) == 2
    assert "training script 'nope.py' not found" in capsys.readouterr().err and not no_torchrun


def test_launch_builds_torchrun_argv_from_file_and_flags(no_torchrun: list, tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("strategy: zero3\nlaunch:\n  num_processes: 4\n  max_restarts: 2\n")
    script = tmp_path / "train.py"
    script.write_text("")
    flags = ["--config", str(cfg), "--nproc-per-node", "2", "--log-dir", "logs", "-t", "3"]
    assert cli.main(["launch", *flags, str(script), "--lr", "1"]) == 0
    (argv,) = no_torchrun
    assert argv == [
        "--nproc-per-node", "2", "--standalone", "--max-restarts", "2", "--log-dir", "logs", "--tee", "3",
        "--module", "shardwise.trainer.run", str(script), "--lr", "1",
    ]


def test_torchrun_argv_multi_node() -> None:
    from shardwise.cli.launch import torchrun_argv
    from shardwise.config import LaunchConfig

    launch = LaunchConfig(num_processes=8, num_nodes=2, node_rank=1, main_address="10.0.0.1", main_port=29555)
    assert torchrun_argv(launch, "train.py", ["--x"]) == [
        "--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "10.0.0.1:29555", "--rdzv-id", "shardwise", "--rdzv-conf", "is_host=false",
        "--max-restarts", "0", "--module", "shardwise.trainer.run", "train.py", "--x",
    ]
    static = LaunchConfig(num_processes=1, num_nodes=2, node_rank=0, rdzv_backend="static")
    assert "--master-addr" in torchrun_argv(static, "t.py")


def test_flags_override_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("shardwise.yaml").write_text("strategy: zero3\nprecision: bf16\n")  # picked up by default
    assert cli.main(["config", "show", "--strategy", "zero1"]) == 0
    out = capsys.readouterr().out
    assert "strategy: zero1" in out and "precision: bf16" in out


def test_code_overrides_file_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("strategy: zero3\nprecision: bf16\ncpu: true\n")
    monkeypatch.setenv("SHARDWISE_CONFIG", str(cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = shardwise.Engine(strategy="zero2", precision="bf16")
    assert engine.config.sharding.strategy == "zero2" and engine.config.sharding.precision == "bf16"
    msgs = [str(w.message) for w in caught if "code overrides" in str(w.message)]
    assert msgs == [f"code overrides the config file: strategy='zero2' in code, 'zero3' in {cfg}"]


def test_the_launchers_own_file_warns_only_where_someone_set_a_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shardwise launch` writes every field of the resolved config; code that changes one still
    at its default (the Accelerator passes grad_accum_steps, a seed) is no conflict, a value the
    user set for the launch is (issue 33)."""
    check_overrides_said(tmp_path, monkeypatch)


def test_an_override_said_nowhere_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with planted_here("override_unsaid"):
        caught(check_overrides_said, tmp_path, monkeypatch, must=r"^warned of code overrides: \[\]")


def check_overrides_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.config.files import write_yaml

    cfg = tmp_path / "resolved.yaml"
    resolved = shardwise.EngineConfig.of(strategy="zero3", cpu=True)
    write_yaml(resolved, cfg, header="# resolved by shardwise launch\n")
    monkeypatch.setenv("SHARDWISE_CONFIG", str(cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = shardwise.Engine(grad_accum_steps=2, seed=3, strategy="zero2")
    cfg_run = engine.config
    assert (cfg_run.training.grad_accum_steps, cfg_run.training.seed) == (2, 3)
    assert cfg_run.sharding.strategy == "zero2"
    msgs = [str(w.message) for w in caught if "code overrides" in str(w.message)]
    assert msgs == [f"code overrides the config file: strategy='zero2' in code, 'zero3' in {cfg}"], \
        f"warned of code overrides: {msgs}"


def test_plain_script_reads_config_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("strategy: zero1\ncpu: true\n")
    monkeypatch.delenv("SHARDWISE_CONFIG", raising=False)
    monkeypatch.setattr("sys.argv", ["train.py", "--config", str(cfg)])
    assert shardwise.Engine().config.sharding.strategy == "zero1"


def test_questionnaire_validates_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    answers = iter(["zero4", "zero3", "bf16", "", "2", "", "yes", "2", "1"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(answers))
    out = tmp_path / "shardwise.yaml"
    assert cli.main(["config", "--output", str(out)]) == 0
    expected = "strategy: expected 'ddp', 'zero1', 'zero2', 'zero3' or 'auto', found 'zero4'"
    assert expected in capsys.readouterr().out
    cfg = load_config(out)
    got = (cfg.sharding.strategy, cfg.sharding.precision, cfg.training.grad_accum_steps,
           cfg.blocks.activation_checkpointing)
    assert got == ("zero3", "bf16", 2, "full")  # "yes" is full checkpointing
    assert (cfg.launch.num_processes, cfg.launch.num_nodes) == (2, 1)


def test_config_with_flags_is_non_interactive_and_refuses_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.yaml"
    assert cli.main(["config", "-o", str(out), "--strategy", "zero2", "--num-processes", "4"]) == 0
    assert load_config(out).launch.num_processes == 4
    assert cli.main(["config", "-o", str(out), "--strategy", "zero3"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "mode"), [
    (["--activation-checkpointing"], "full"), (["--no-activation-checkpointing"], "none"),
    (["--activation-checkpointing-mode", "selective"], "selective"),
    (["--activation-checkpointing-mode", "offload"], "offload"), ([], "none"),
])
def test_activation_checkpointing_flags_keep_the_bool_spelling_and_name_a_mode(
    tmp_path: Path, flags: list[str], mode: str
) -> None:
    """The bool flag pair still means full/none (a value after it would swallow `launch`'s script
    name); a mode has its own flag; a YAML's true/false is full/none."""
    out = tmp_path / "s.yaml"
    assert cli.main(["config", "-o", str(out), "--strategy", "zero3", *flags]) == 0
    assert load_config(out).activation_checkpointing == mode
    ns = cli.build_parser().parse_args(["launch", *flags, "train.py"])
    assert ns.training_script == "train.py"
    for value, want in ((True, "full"), (False, "none"), ("selective", "selective")):
        assert shardwise.EngineConfig.of(activation_checkpointing=value).activation_checkpointing == want


def test_env_report(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for needle in (
        f"torch:         {torch.__version__}",
        "shardwise:",
        "deepspeed:",
        "transformers:",
        "backends:      gloo",
        "cpus:",
        "memory:",
    ):
        assert needle in out


def _torchrun_options() -> set[str]:
    from torch.distributed.run import get_args_parser

    return {s for a in get_args_parser()._actions for s in a.option_strings} - {"-h", "--help"}


def _describe(parser, prefix: str = "shardwise") -> list[str]:
    """Our subcommands and flags (torchrun's own, which depend on the torch version, left out)."""
    lines = []
    torchrun = _torchrun_options()
    for action in parser._actions:
        if action.choices and isinstance(action.choices, dict):
            for name, sub in sorted(action.choices.items()):
                lines += _describe(sub, f"{prefix} {name}")
        elif set(action.option_strings) & torchrun or action.dest in (
            "training_script", "training_script_args"
        ):
            continue
        elif action.option_strings:
            lines.append(f"{prefix} {' '.join(action.option_strings)}")
        else:
            lines.append(f"{prefix} <{action.dest}>")
    return lines


def test_cli_surface_is_frozen() -> None:
    _golden("cli.txt", "\n".join(_describe(cli.build_parser())) + "\n")


def test_launch_accepts_every_torchrun_flag() -> None:
    parser = cli.build_parser()
    launch = parser._subparsers._group_actions[0].choices["launch"]
    ours = {s for a in launch._actions for s in a.option_strings}
    assert _torchrun_options() <= ours


# -- hybrid sharding: the Accelerate and DeepSpeed spellings of a sharding group -----------------
def _fsdp_yaml(strategy: str | None = None, processes: int = 4, **parallelism: int) -> dict:
    fsdp = {"fsdp_sharding_strategy": strategy} if strategy else {}
    acc = {"distributed_type": "FSDP", "num_processes": processes, "num_machines": 2, "fsdp_config": fsdp}
    if parallelism:
        acc["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in parallelism.items()}
    return acc


@pytest.mark.parametrize(("spelling", "strategy"), [
    ("HYBRID_SHARD", "zero3"), ("4", "zero3"), ("HYBRID_SHARD_ZERO2", "zero2"), ("5", "zero2"),
])
def test_accelerate_hybrid_shard_imports_to_node_groups(spelling: str, strategy: str) -> None:
    from shardwise.config.translate import from_accelerate

    for value in (spelling, int(spelling) if spelling.isdigit() else spelling):
        settings, dropped = from_accelerate(_fsdp_yaml(value))  # type: ignore[arg-type]
        assert (settings["strategy"], settings["shard_group_size"]) == (strategy, "node")
        assert dropped == []  # the hybrid key is no longer a dropped note
        fsdp2 = {**_fsdp_yaml(), "fsdp_config": {"fsdp_reshard_after_forward": str(value)}}  # FSDP2
        assert from_accelerate(fsdp2)[0]["shard_group_size"] == "node"


@pytest.mark.parametrize(("strategy", "sizes", "want"), [
    ("HYBRID_SHARD", {"dp_replicate_size": 2, "dp_shard_size": 2}, ("zero3", None, (2, 2))),
    ("HYBRID_SHARD_ZERO2", {"dp_replicate_size": 4, "dp_shard_size": 1 * 1}, None),  # refused below
    (None, {"dp_replicate_size": 2, "dp_shard_size": 2}, ("zero3", None, (2, 2))),  # FSDP2: by the mesh
    ("SHARD_GRAD_OP", {"dp_replicate_size": 1, "dp_shard_size": 4}, ("zero2", None, (1, 4))),
    ("HYBRID_SHARD", {"dp_replicate_size": 1, "dp_shard_size": 4}, ("zero3", None, (1, 4))),  # sizes win
    ("HYBRID_SHARD", {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1}, ("zero3", "node", None)),
])
def test_accelerate_parallelism_config_sets_the_group(strategy: str | None, sizes: dict, want: tuple | None
                                                      ) -> None:
    """The sizes fill the `parallelism` section (dp_replicate, dp_shard), over HYBRID_SHARD's
    node default; all 1 asks for nothing, and the node default stands."""
    from shardwise.config import ConfigError
    from shardwise.config.translate import from_accelerate

    acc = _fsdp_yaml(strategy, **sizes)
    if want is None:
        with pytest.raises(ConfigError, match="parallelism_config: dp_replicate_size=4 with dp_shard_size=1"):
            from_accelerate(acc)
        return
    settings, dropped = from_accelerate(acc)
    section = settings.get("parallelism")
    got = (settings["strategy"], settings.get("shard_group_size"),
           None if section is None else (section["dp_replicate"], section["dp_shard"]))
    assert got == want
    assert dropped == []
    out = shardwise.EngineConfig.of(**{k: v for k, v in settings.items() if k != "launch"})
    assert out.shard_group_size == want[1]
    assert (out.parallelism.dp_replicate, out.parallelism.dp_shard) == (want[2] or (None, None))


def test_accelerate_tp_size_becomes_tensor_parallel_size() -> None:
    """`parallelism_config_tp_size` (Accelerate's YAML) and `ParallelismConfig(tp_size=...)` fields:
    the `parallelism` section's sizes (tensor parallelism inside, the rest data parallel; their
    product: the processes)."""
    from shardwise.config.translate import from_accelerate, from_parallelism

    settings, dropped = from_accelerate(_fsdp_yaml(None, dp_shard_size=2, tp_size=2))
    assert (settings["strategy"], settings.get("shard_group_size"), settings["parallelism"]) == (
        "zero3", None, {"dp_replicate": 1, "dp_shard": 2, "tp": 2}) and dropped == []
    cfg = shardwise.EngineConfig.of(**{k: v for k, v in settings.items() if k != "launch"})
    assert cfg.parallelism.tp == 2 and cfg.parallelism.tp == 2  # the flat key follows the section
    assert from_parallelism({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, 8) == {
        "dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert from_parallelism({"parallelism_config_tp_size": 4}) == {"tp": 4}
    assert from_parallelism({"tp_size": None}) is None


def test_accelerate_hybrid_file_round_trips_through_the_cli(tmp_path: Path) -> None:
    import yaml

    src = tmp_path / "acc.yaml"
    src.write_text(yaml.safe_dump(_fsdp_yaml("HYBRID_SHARD_ZERO2", dp_replicate_size=2, dp_shard_size=2)))
    out = tmp_path / "shardwise.yaml"
    assert cli.main(["config", "--from-accelerate", str(src), "--output", str(out)]) == 0
    cfg = load_config(out)
    assert (cfg.sharding.strategy, cfg.sharding.shard_group_size, cfg.launch.num_processes) == (
        "zero2", None, 2)
    assert (cfg.parallelism.dp_replicate, cfg.parallelism.dp_shard) == (2, 2)
    assert "dropped" not in out.read_text()


def test_parallelism_config_object_fields_and_yaml_keys_agree() -> None:
    from shardwise.config.translate import from_parallelism

    fields = {"dp_replicate_size": 2, "dp_shard_size": 4, "tp_size": 1, "cp_size": None}
    want = {"dp_replicate": 2, "dp_shard": 4}  # (tp_size=1: not set, left implied)
    assert from_parallelism(fields, 8) == want  # a ParallelismConfig's attributes (None: unset)
    assert from_parallelism({f"parallelism_config_{k}": v for k, v in fields.items()}, 8) == want
    assert from_parallelism({"dp_shard_size": 8}, 8) == {"dp_replicate": 1, "dp_shard": 8}
    assert from_parallelism({}, 8) is None
    # context parallelism's size goes into the section (the method: ring, as Accelerate's)
    assert from_parallelism({"dp_shard_size": 2, "cp_size": 2}, 4) == {"dp_replicate": 1, "dp_shard": 2,
                                                                       "cp": 2}
    # sp_size (Accelerate's Ulysses, through DeepSpeed there): the same dimension, shardwise's Ulysses
    assert from_parallelism({"sp_size": 2, "sp_backend": "deepspeed"}, 2) == {"cp": 2, "cp_method": "ulysses"}
    from shardwise.config.translate import from_accelerate

    yaml, _dropped = from_accelerate(_fsdp_yaml(None, processes=4, dp_shard_size=2, sp_size=2))
    assert yaml["parallelism"]["cp_method"] == "ulysses" and yaml["parallelism"]["cp"] == 2


def test_a_parallelism_config_writes_only_what_was_set() -> None:
    """Accelerate's `ParallelismConfig` (every size defaults to 1) fills the section with the sizes
    set above 1 only: a size of 1 stays implied and yields to another spelling of it, where a
    written `tp: 1` would have to agree with `tensor_parallel_size`."""
    from types import SimpleNamespace

    from shardwise.accelerate.rules import read_parallelism
    from shardwise.config.translate import from_parallelism

    sizes = SimpleNamespace(dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=2, sp_size=1)
    assert from_parallelism(vars(sizes), 2) == {"cp": 2}
    kwargs: dict[str, object] = {"parallelism_config": sizes, "context_parallel": "ring"}
    read_parallelism(kwargs, 2)  # (`Accelerator(parallelism_config=...)` on 2 processes)
    assert kwargs == {"parallelism": {"cp": 2}, "context_parallel": "ring"}
    assert EngineConfig.of(**kwargs).parallelism.cp == 2
    # the process count unknown (a YAML without num_processes): the unset tp_size yields to the flat key
    cfg = EngineConfig.of(parallelism=from_parallelism(vars(sizes)), tensor_parallel_size=2)
    assert (cfg.parallelism.cp, cfg.parallelism.tp, cfg.parallelism.cp_method) == (2, 2, "ring")
    with pytest.raises(ConfigError, match=r"parallelism.tp=1 and tensor_parallel_size=2 disagree"):
        EngineConfig.of(parallelism={"tp": 1, "cp": 2}, tensor_parallel_size=2)  # (what it wrote before)
    ulysses = SimpleNamespace(dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=1, sp_size=2)
    assert from_parallelism(vars(ulysses), 2) == {"cp": 2, "cp_method": "ulysses"}


@pytest.mark.parametrize(("acc", "message"), [
    (_fsdp_yaml("HYBRID_SHARD", processes=8, dp_replicate_size=2, dp_shard_size=2),
     "dp_replicate_size=2 x dp_shard_size=2 x tp_size=1 must equal the 8 processes"),
    (_fsdp_yaml(None, dp_replicate_size=2, dp_shard_size=2, tp_size=2),
     "dp_replicate_size=2 x dp_shard_size=2 x tp_size=2 must equal the 4 processes"),
    (_fsdp_yaml(None, dp_shard_size=2, sp_size=2, cp_size=2), "cp_size=2 and sp_size=2: one context-parallel "
     "dimension at a time"),
    (_fsdp_yaml(None, dp_shard_size=2, cp_size=4),
     "dp_replicate_size=1 x dp_shard_size=2 x tp_size=1 x cp_size=4 must equal the 4 processes"),
    (_fsdp_yaml(None, dp_replicate_size=0, dp_shard_size=4), "dp_replicate_size: expected an integer >= 1"),
    (_fsdp_yaml(None, dp_shard_size="two"), "dp_shard_size: expected a number"),  # type: ignore[arg-type]
    ({"distributed_type": "MULTI_GPU", "num_processes": 4, "parallelism_config": {
        "parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}},
     "dp_shard_size > 1 shards the model, which Accelerate does under distributed_type FSDP only"),
])
def test_bad_parallelism_config_is_refused_naming_the_key(acc: dict, message: str) -> None:
    from shardwise.config import ConfigError
    from shardwise.config.translate import from_accelerate

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_accelerate(acc)


def _zero(**keys: object) -> dict:
    return {"zero_optimization": {"stage": 3, **keys}}


def test_deepspeed_mics_imports_to_a_sharding_group() -> None:
    from shardwise.config.translate import from_deepspeed

    settings, dropped = from_deepspeed(_zero(mics_shard_size=2))
    assert (settings["strategy"], settings["shard_group_size"]) == ("zero3", 2)
    assert dropped == []
    settings, dropped = from_deepspeed(_zero(mics_shard_size=-1, mics_hierarchical_params_gather=False,
                                             zero_hpz_partition_size=1))
    assert "shard_group_size" not in settings and dropped == []  # MiCS and hpZ off: nothing asked for
    settings, dropped = from_deepspeed(_zero(mics_shard_size=4, mics_hierarchical_params_gather=True))
    assert settings["shard_group_size"] == 4
    assert dropped == ["zero_optimization.mics_hierarchical_params_gather (MiCS's two-hop all-gather: "
                       "shardwise gathers within the group directly)"]


def test_deepspeed_mics_file_loads_as_hybrid_zero3(tmp_path: Path) -> None:
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_zero(mics_shard_size=8)))
    cfg = load_config(path)
    assert (cfg.sharding.strategy, cfg.sharding.shard_group_size) == ("zero3", 8)


def test_deepspeed_hpz_is_reported_not_made_a_group() -> None:
    """hpZ shards optimizer states over all processes: not a sharding group; DeepSpeed runs it."""
    from shardwise.config.translate import from_deepspeed

    settings, dropped = from_deepspeed(_zero(zero_hpz_partition_size=2))
    assert (settings["strategy"], "shard_group_size" in settings) == ("zero3", False)
    assert dropped == ["zero_optimization.zero_hpz_partition_size (ZeRO++ hpZ: run as given by "
                       "backend='deepspeed'; for hybrid sharding set shard_group_size)"]


@pytest.mark.parametrize(("ds", "message"), [
    (_zero(zero_hpz_partition_size=-2), "zero_hpz_partition_size: expected an integer >= 0, found -2"),
    (_zero(mics_shard_size=0), "zero_optimization.mics_shard_size: expected a positive integer"),
    (_zero(mics_shard_size="many"), "zero_optimization.mics_shard_size: expected a number"),
    ({"zero_optimization": {"stage": 2, "mics_shard_size": 2}},
     "zero_optimization.mics_shard_size: MiCS is ZeRO stage 3's; found stage 2"),
])
def test_bad_deepspeed_hybrid_keys_are_refused_naming_the_key(ds: dict, message: str) -> None:
    from shardwise.config import ConfigError
    from shardwise.config.translate import from_deepspeed

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        from_deepspeed(ds)
