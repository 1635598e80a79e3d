"""The config tree's sections and the translators of foreign formats, in one process
(`shardwise.config`): each section refuses its own bad values in one line naming the key, flat
keys keep their meaning, and the translators report what they drop."""

from __future__ import annotations

from typing import Any

import pytest

from shardwise.config import ConfigError, EngineConfig, LaunchConfig, LossScaleConfig
from shardwise.config.files import config_with_code, merge
from shardwise.config.translate import from_accelerate, from_deepspeed, from_dynamo, from_parallelism

BAD = [  # (keys, what the one line names)
    ({"strategy": "zero4"}, "strategy"),
    ({"strategy": "ddp", "offload": "params"}, "offload"),
    ({"shard_group_size": 0}, "shard_group_size"),
    ({"grad_accum_steps": 0}, "grad_accum_steps"),
    ({"seed": 1.5}, "seed"),
    ({"checkpoint_every_steps": 0}, "checkpoint_every_steps"),
    ({"keep_last": True}, "keep_last"),
    ({"resume": "sometimes"}, "resume"),
    ({"log_every_steps": -1}, "log_every_steps"),
    ({"log_with": "mlflow"}, "log_with"),
    ({"collective_timeout_s": 1.0}, "collective_timeout_s"),
    ({"preempt_signals": ("SIGKILL",)}, "preempt_signals"),
    ({"activation_checkpointing_every": 2}, "activation_checkpointing_every"),
    ({"compile_backend": ""}, "compile_backend"),
    ({"wrap": (3,)}, "wrap"),
]


@pytest.mark.parametrize(("keys", "named"), BAD, ids=[k for _, k in BAD])
def test_each_section_refuses_its_bad_values_in_one_line(keys: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig.of(**keys)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_flat_keys_keep_their_meaning() -> None:
    cfg = EngineConfig.of(activation_checkpointing=True, preempt_signals="SIGUSR1", wrap="Block",
                       loss_scale={"init_scale": 8.0}, launch={"num_processes": 2})
    assert cfg.blocks.activation_checkpointing == "full" and cfg.supervision.preempt_signals == ("SIGUSR1",)
    assert cfg.blocks.wrap == ("Block",) and isinstance(cfg.sharding.loss_scale, LossScaleConfig)
    assert isinstance(cfg.launch, LaunchConfig) and cfg.launch.num_processes == 2


def test_the_nested_sections_check_themselves() -> None:
    with pytest.raises(ConfigError, match="backoff_factor"):
        LossScaleConfig(backoff_factor=1.5)
    with pytest.raises(ConfigError, match="node_rank"):
        LaunchConfig(num_nodes=2, node_rank=2)


def test_merge_layers_nested_sections_key_by_key() -> None:
    merged = merge({"a": 1, "launch": {"x": 1, "y": 2}}, {"launch": {"y": 3}})
    assert merged == {"a": 1, "launch": {"x": 1, "y": 3}}


def test_code_wins_over_the_file_and_names_only_what_someone_set(tmp_path: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("strategy: zero3\ngrad_accum_steps: 1\n")
    cfg, conflicts = config_with_code({"strategy": "ddp", "grad_accum_steps": 4}, path)
    assert (cfg.sharding.strategy, cfg.training.grad_accum_steps) == ("ddp", 4)
    assert conflicts == [f"strategy='ddp' in code, 'zero3' in {path}"]  # grad_accum_steps 1: the default


def test_a_deepspeed_json_becomes_settings_and_dropped_keys() -> None:
    out, dropped = from_deepspeed({
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "overlap_comm": True},
        "bf16": {"enabled": True}, "gradient_accumulation_steps": 4, "gradient_clipping": "auto",
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
    })
    assert out == {"strategy": "zero3", "offload": "params", "precision": "bf16", "grad_accum_steps": 4,
                   "max_grad_norm": 1.0, "micro_batch_size": 2}
    assert dropped == ["zero_optimization.overlap_comm", "steps_per_print"]


def test_deepspeed_fp16_brings_its_loss_scaling_and_zero_clipping_switches_it_off() -> None:
    out, _ = from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 12}, "gradient_clipping": 0})
    assert out["precision"] == "fp16" and out["loss_scale"]["init_scale"] == 2.0**12
    assert out["max_grad_norm"] is None


def test_deepspeed_autotp_size_is_tensor_parallel_size() -> None:
    out, dropped = from_deepspeed({"zero_optimization": {"stage": 2},
                                   "tensor_parallel": {"autotp_size": 4, "tp_overlap_comm": True}})
    assert out == {"strategy": "zero2", "tensor_parallel_size": 4}
    assert dropped == ["tensor_parallel.tp_overlap_comm"]
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_size: expected an integer >= 1"):
        from_deepspeed({"tensor_parallel": {"autotp_size": 0}})


def test_a_bad_deepspeed_stage_is_named() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage"):
        from_deepspeed({"zero_optimization": {"stage": 4}})


def test_an_accelerate_yaml_becomes_settings_and_launch_flags() -> None:
    out, dropped = from_accelerate({
        "distributed_type": "MULTI_CPU", "mixed_precision": "bf16", "num_machines": 2, "num_processes": 8,
        "machine_rank": 1, "main_process_ip": "10.0.0.1", "main_process_port": 1234,
        "gradient_accumulation_steps": 2, "downcast_bf16": "yes",
    })
    assert out["strategy"] == "ddp" and out["cpu"] and out["precision"] == "bf16"
    assert out["launch"] == {"num_processes": 4, "num_nodes": 2, "node_rank": 1, "main_address": "10.0.0.1",
                             "main_port": 1234}
    assert out["grad_accum_steps"] == 2 and dropped == ["downcast_bf16"]


def test_accelerates_processes_must_divide_among_its_machines() -> None:
    with pytest.raises(ConfigError, match="not a multiple of num_machines"):
        from_accelerate({"distributed_type": "MULTI_GPU", "num_machines": 2, "num_processes": 3})


def test_parallelism_sizes_fill_the_parallelism_section() -> None:
    assert from_parallelism({"dp_replicate_size": 2, "dp_shard_size": 4}, 8) == {
        "dp_replicate": 2, "dp_shard": 4}  # (tp_size unset: left implied, it yields to another spelling)
    assert from_parallelism({"dp_shard_size": 4, "tp_size": 2}, 8) == {  # tp inside, dp around it
        "dp_replicate": 1, "dp_shard": 4, "tp": 2}
    with pytest.raises(ConfigError, match="x tp_size=2 must equal the 8 processes"):
        from_parallelism({"tp_size": 2}, 8)


def test_dynamo_settings_become_compile() -> None:
    out, notes = from_dynamo({"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune"})
    assert out["compile"] is True and out["compile_backend"] == "inductor"
    assert out["compile_mode"] == "max-autotune"
    assert len(notes) == 1 and notes[0].startswith("use_regional_compilation (false")  # we compile blocks
    _, notes = from_dynamo({"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True})
    assert notes == []
