"""Accelerate's plugin objects and launcher variables, read in one process (issue 44): each
translates exactly as its file form does (one code path: the plugin, the launcher's variables and
the Accelerate YAML give the same settings), fields not applied are named in one warning, and
contradictions are refused in one line."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("accelerate")

from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin, TorchTensorParallelPlugin

from shardwise.accelerate.plugins import read_plugins
from shardwise.cli.env import accelerate_line
from shardwise.config import ConfigError
from shardwise.config.translate import from_accelerate

ACC = {"compute_environment": "LOCAL_MACHINE", "num_machines": 1, "num_processes": 2, "mixed_precision": "no"}


@pytest.fixture(autouse=True)
def _environment_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accelerate's FSDP plugin writes FSDP_CPU_RAM_EFFICIENT_LOADING into the environment, which
    the next plugin reads: each test gets the environment back as it was."""
    import os

    for key in list(os.environ):
        if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "False")


def _read(**kwargs: object) -> tuple[dict, list[str]]:
    """The settings `read_plugins` sets, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings, _ = read_plugins(dict(kwargs))
    return settings, [str(w.message) for w in caught if "shardwise does not apply" in str(w.message)]


def _yaml(**acc: object) -> dict:
    settings, _ = from_accelerate({**ACC, **acc})
    settings.pop("launch")
    settings.pop("precision", None)  # (the YAML's mixed_precision: no; a plugin says none)
    return settings


@pytest.mark.parametrize(("plugin", "fsdp_config"), [
    ({"fsdp_version": 2, "reshard_after_forward": True, "auto_wrap_policy": "transformer_based_wrap",
      "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "SHARDED_STATE_DICT"},
     {"fsdp_version": 2, "fsdp_reshard_after_forward": True,
      "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
      "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
      "fsdp_state_dict_type": "SHARDED_STATE_DICT"}),
    ({"sharding_strategy": "SHARD_GRAD_OP", "activation_checkpointing": True,
      "state_dict_type": "SHARDED_STATE_DICT"},
     {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_activation_checkpointing": True,
      "fsdp_state_dict_type": "SHARDED_STATE_DICT"}),
    ({"sharding_strategy": "HYBRID_SHARD", "cpu_offload": True, "state_dict_type": "SHARDED_STATE_DICT"},
     {"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_offload_params": True,
      "fsdp_state_dict_type": "SHARDED_STATE_DICT"}),
])
def test_the_fsdp_plugin_translates_as_its_yaml_does(plugin: dict, fsdp_config: dict) -> None:
    settings, notes = _read(fsdp_plugin=FullyShardedDataParallelPlugin(**plugin))
    assert settings == _yaml(distributed_type="FSDP", fsdp_config=fsdp_config)
    assert notes == []  # nothing asked that is not applied


def test_the_deepspeed_plugin_translates_as_its_yaml_and_json_do(tmp_path: object) -> None:
    settings, notes = _read(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu",
                                                             gradient_clipping=1.0))
    want = {"backend": "deepspeed", "strategy": "zero2", "offload": "optimizer", "max_grad_norm": 1.0}
    assert {k: settings[k] for k in want} == want and notes == []
    yaml = _yaml(distributed_type="DEEPSPEED", deepspeed_config={
        "zero_stage": 2, "offload_optimizer_device": "cpu", "offload_param_device": "none",
        "gradient_clipping": 1.0})
    assert {k: yaml[k] for k in want} == want
    # hf_ds_config as a dict: the DeepSpeed JSON's translation; zero3_init_flag named as not applied
    zero3 = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}})
    settings, notes = _read(deepspeed_plugin=zero3)
    assert (settings["backend"], settings["strategy"]) == ("deepspeed", "zero3")
    assert len(notes) == 1 and "zero3_init_flag" in notes[0]


def test_the_tensor_parallel_plugin_is_the_parallelism_sections_tp() -> None:
    settings, _ = _read(torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2))
    assert settings == {"parallelism": {"tp": 2}}


def test_fields_not_applied_are_named_in_one_warning() -> None:
    _, notes = _read(fsdp_plugin=FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=True))
    assert len(notes) == 1
    assert "state_dict_type=FULL_STATE_DICT" in notes[0] and "cpu_ram_efficient_loading" in notes[0]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"deepspeed_plugin": "ds", "fsdp_plugin": "fsdp"}, "two plugins for two engines"),
    ({"deepspeed_plugins": {"a": "ds", "b": "ds"}},
     "several DeepSpeed configs, one per model, are not supported"),
    ({"fsdp_plugin": "zero2", "strategy": "zero3"},
     "Accelerator(strategy='zero3') and the Accelerate plugin's strategy='zero2' disagree"),
])
def test_contradictions_are_refused_in_one_line(kwargs: dict, message: str) -> None:
    plugins = {"ds": DeepSpeedPlugin(zero_stage=2), "fsdp": FullyShardedDataParallelPlugin(),
               "zero2": FullyShardedDataParallelPlugin(sharding_strategy="SHARD_GRAD_OP")}

    def named(v: object) -> object:
        if isinstance(v, dict):
            return {n: plugins[p] for n, p in v.items()}
        return plugins[v] if isinstance(v, str) and v in plugins else v

    given = {k: named(v) for k, v in kwargs.items()}
    with pytest.raises(ConfigError) as refused:
        read_plugins(given)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_single_deepspeed_plugins_entry_is_the_plugin() -> None:
    settings, _ = _read(deepspeed_plugins={"student": DeepSpeedPlugin(zero_stage=3)})
    assert (settings["backend"], settings["strategy"]) == ("deepspeed", "zero3")


def test_megatron_is_refused_naming_the_alternative() -> None:
    from shardwise.accelerate.rules import refuse_unsupported

    with pytest.raises(ConfigError, match=r"megatron_lm_plugin=\.\.\.\): Megatron-LM.*tensor_parallel_size"):
        refuse_unsupported({"megatron_lm_plugin": object()}, device_placement=True)


@pytest.mark.parametrize(("env", "want", "variable"), [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false",
      "FSDP_OFFLOAD_PARAMS": "false"}, {"strategy": "zero2"}, "ACCELERATE_USE_FSDP"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
      "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"},
     {"backend": "deepspeed", "strategy": "zero3", "offload": "params"}, "ACCELERATE_USE_DEEPSPEED"),
    ({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2"}, {}, ""),
])
def test_the_launchers_variables_give_the_plugins_settings(monkeypatch: pytest.MonkeyPatch, env: dict,
                                                            want: dict, variable: str) -> None:
    """`accelerate launch --config_file X.yaml` exports these; the Accelerator reads them as
    Accelerate builds its plugins from them, and `shardwise env` says so."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    kwargs: dict = {}
    settings, source = read_plugins(kwargs)
    assert {k: settings[k] for k in want} == want
    if variable:
        assert source == f"Accelerate's launcher ({variable})"
        line = accelerate_line(env)
        assert line is not None and variable in line and f"strategy={want['strategy']!r}" in line
    else:  # ParallelismConfig from PARALLELISM_CONFIG_*: left for read_parallelism, as a script's own
        assert kwargs["parallelism_config"].tp_size == 2
    assert accelerate_line({}) is None


def test_a_plugin_and_the_config_file_that_disagree_are_refused(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: object) -> None:
    from pathlib import Path

    from shardwise.accelerate.plugins import check_config_file

    config = Path(str(tmp_path)) / "shardwise.yaml"
    config.write_text("strategy: zero2\n")
    monkeypatch.setenv("SHARDWISE_CONFIG", str(config))
    settings, source = read_plugins({"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)})
    with pytest.raises(ConfigError) as refused:
        check_config_file(settings, source)
    said = str(refused.value)
    assert said.startswith("Accelerator(fsdp_plugin=...) and the config file disagree: strategy='zero3'")
    assert "'zero2' in " in said and "\n" not in said
    agreeing = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False)  # zero2
    check_config_file(*read_plugins({"fsdp_plugin": agreeing}))
