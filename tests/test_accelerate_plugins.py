"""Accelerate's plugin objects configure shardwise (issue 44), each run against one plain process.

A script in Accelerate's pattern passes its plugin to `Accelerator(...)` with only the import
changed: `DeepSpeedPlugin` (zero 2 with optimizer offload; zero 3 from `hf_ds_config` as a dict
and as a file: backend deepspeed), `FullyShardedDataParallelPlugin` (FULL_SHARD on FSDP2 with
transformer-based wrapping and a sharded state dict; SHARD_GRAD_OP with activation checkpointing;
HYBRID_SHARD with cpu_offload) and `TorchTensorParallelPlugin(tp_size=2)`. Each run's config is
the one the same settings give as a shardwise config (the translation is checked field by field),
and trains what one process trains on the same global batches (fp32; losses, clipped norms and
final weights within 1e-5, as tests/test_tensor_parallel.py; 1e-4 for DeepSpeed's offload, whose
host Adam sums in another order, as tests/test_deepspeed.py). 2 CPU processes, two spawns: the
torch backend's cases, then DeepSpeed's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")
GLOBAL, STEPS = 4, 3

# the same settings, as a shardwise config would give them
TORCH_CASES: dict[str, dict[str, Any]] = {
    "fsdp2_full_shard": {"strategy": "zero3", "wrap": ("LlamaDecoderLayer",), "offload": "none"},
    "fsdp1_shard_grad_op_ac": {"strategy": "zero2", "activation_checkpointing": "full"},
    "fsdp1_hybrid_offload": {"strategy": "zero3", "shard_group_size": "node", "offload": "params"},
    "tp_plugin": {"tensor_parallel_size": 2},
}
DS_CASES: dict[str, dict[str, Any]] = {
    "ds_zero2_offload": {"backend": "deepspeed", "strategy": "zero2", "offload": "optimizer",
                         "max_grad_norm": 1.0, "micro_batch_size": "auto", "train_batch_size": "auto"},
    "ds_zero3_dict": {"backend": "deepspeed", "strategy": "zero3", "max_grad_norm": 1.0,
                      "micro_batch_size": "auto"},
    "ds_zero3_file": {"backend": "deepspeed", "strategy": "zero3", "max_grad_norm": 1.0,
                      "micro_batch_size": "auto"},
}
DS_JSON = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0,
           "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}


def _plugin(case: str, ds_file: str) -> dict[str, Any]:
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin, TorchTensorParallelPlugin

    if case == "fsdp2_full_shard":  # the pattern of Accelerate's ND-parallel example
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], state_dict_type="SHARDED_STATE_DICT")}
    if case == "fsdp1_shard_grad_op_ac":
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            sharding_strategy="SHARD_GRAD_OP", activation_checkpointing=True,
            state_dict_type="SHARDED_STATE_DICT")}
    if case == "fsdp1_hybrid_offload":
        return {"fsdp_plugin": FullyShardedDataParallelPlugin(
            sharding_strategy="HYBRID_SHARD", cpu_offload=True, state_dict_type="SHARDED_STATE_DICT")}
    if case == "tp_plugin":
        return {"torch_tp_plugin": TorchTensorParallelPlugin(tp_size=2)}
    if case == "ds_zero2_offload":
        return {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu",
                                                    gradient_clipping=1.0)}
    if case == "ds_zero3_dict":
        return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=dict(DS_JSON))}
    return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=ds_file)}


def _one(case: str, ds_file: str) -> dict[str, Any]:
    from shardwise import Accelerator  # the script's one changed line

    accelerator = Accelerator(cpu=True, seed=W.SEED, **_plugin(case, ds_file))
    cfg = accelerator.config
    torch.manual_seed(W.SEED)
    model = W.build("llama")
    opt = W.make_optimizer(model)
    dp = accelerator.parallelism_config.data_parallel_size if accelerator.parallelism_config else 2
    loader = DataLoader(W.Tokens(GLOBAL * STEPS), batch_size=GLOBAL // dp, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses, norms = [], []
    for ids in loader:
        loss = W.lm_loss(model, ids)
        accelerator.backward(loss)
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
    state = accelerator.get_state_dict(model)
    return {"losses": losses, "norms": norms, "state": state, "settings": fields(cfg),
            "end": accelerator.end_training}


def fields(cfg: Any) -> dict[str, Any]:
    """Every field of a config tree, by its section's path (`sharding.strategy`, ...)."""
    import dataclasses

    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section):
            out.update({f"{f.name}.{g.name}": getattr(section, g.name) for g in dataclasses.fields(section)})
        else:
            out[f.name] = section
    return out


def _cases(cases: list[str], ds_file: str) -> dict[str, Any]:
    """The cases one after another in one process group (DeepSpeed keeps its groups for the
    process's life), ended once."""
    runs = {case: _one(case, ds_file) for case in cases}
    for run in runs.values():
        end = run.pop("end")
    end()
    return runs


def _check(runs: list[dict[str, Any]], cases: dict[str, dict[str, Any]], tol: dict[str, float]) -> None:
    ref = W.reference("llama", world=2, batch=GLOBAL // 2, accum=1, steps=STEPS)
    from shardwise.config.tree import EngineConfig

    for case, want in cases.items():  # every field: the config the same settings give as shardwise's own
        settings, same = runs[0][case]["settings"], fields(EngineConfig.of(cpu=True, seed=W.SEED, **want))
        differ = {k: (settings.get(k), v) for k, v in same.items() if settings.get(k) != v}
        assert not differ and settings.keys() == same.keys(), \
            f"{case}: fields (the plugin's, shardwise's): {differ}"
        for rank in runs:
            got = rank[case]
            assert W.close(got["losses"], ref.losses) < tol.get(case, 1e-5), (case, got["losses"], ref.losses)
            assert W.close(got["norms"], ref.norms) < tol.get(case, 1e-5), (case, got["norms"], ref.norms)
        assert W.max_diff(runs[0][case]["state"], ref.state) < tol.get(case, 1e-5), case


def test_fsdp_and_tensor_parallel_plugins_train_what_one_process_trains() -> None:
    runs = spawn(_cases, 2, list(TORCH_CASES), "")
    _check(runs, TORCH_CASES, {})


def test_a_plugin_field_dropped_is_caught() -> None:
    """Planted `plugin_wrap_dropped`: the FSDP plugin's block classes lost on the way (the blocks
    are detected anyway: the same numbers); the settings' check must fail."""
    case = "fsdp2_full_shard"
    runs = spawn(planted(_cases, "plugin_wrap_dropped"), 2, [case], "")
    caught(_check, runs, {case: TORCH_CASES[case]}, {}, must=r"fsdp2_full_shard: fields .*'blocks\.wrap'")


def test_deepspeed_plugins_train_what_one_process_trains(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps(DS_JSON))
    runs = spawn(_cases, 2, list(DS_CASES), str(ds_file))
    _check(runs, DS_CASES, {"ds_zero2_offload": 1e-4})


# -- Accelerate's launcher: `accelerate launch --config_file X.yaml` = `shardwise launch --config X.yaml` --
SCRIPT = Path(__file__).parent / "scripts" / "launcher_settings.py"
LAUNCH_YAMLS = {
    "fsdp": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
             "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
             "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
             "  fsdp_reshard_after_forward: true\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
             "  fsdp_activation_checkpointing: true\n",
             {"strategy": "zero3", "backend": "torch", "wrap": ["LlamaDecoderLayer"],
              "activation_checkpointing": "full"}),
    "deepspeed": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"
                  "  offload_optimizer_device: cpu\n  offload_param_device: none\n"
                  "  gradient_accumulation_steps: 1\n  gradient_clipping: 1.0\n",
                  {"strategy": "zero2", "backend": "deepspeed", "offload": "optimizer"}),
}
COMMON_YAML = ("compute_environment: LOCAL_MACHINE\nmixed_precision: 'no'\nnum_machines: 1\n"
               "num_processes: 2\nuse_cpu: true\n")


def _launched(cmd: list[str], out: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The script's results under a launcher: it must exit 0 within 300 s and say it finished."""
    import os
    import subprocess
    import sys

    from spawn import kill_tree

    env = {**(os.environ if env is None else env), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    env.pop("SHARDWISE_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", *cmd, str(SCRIPT), str(out)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        pytest.fail(f"{cmd[0]} still running after 300 s (a hang)")
    assert proc.returncode == 0, f"{cmd}: exited {proc.returncode}\n{err[-4000:]}"
    results = json.loads(out.read_text())
    assert results["done"], results
    results["state"] = torch.load(out.with_suffix(".pt"))
    return results


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_accelerate_launch_config_file_trains_as_shardwise_launch(engine: str, tmp_path: Path) -> None:
    """The script passes no plugin: under `accelerate launch --config_file X.yaml` its settings
    come from the launcher's variables (ACCELERATE_USE_FSDP and FSDP_*, ACCELERATE_USE_DEEPSPEED and
    ACCELERATE_DEEPSPEED_*), and equal what `shardwise launch --config X.yaml` reads from the same
    file; both train what one process trains."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    check_launchers_agree(engine, *_both_launchers(engine, tmp_path))


def test_planted_launcher_variables_unread_is_caught(tmp_path: Path) -> None:
    """`launcher_variables_unread`: under `accelerate launch` the FSDP variables are not read; the
    run trains with shardwise's defaults, which the check of its settings refuses."""
    from planted import caught, fault_env

    caught(check_launchers_agree, "fsdp",
           *_both_launchers("fsdp", tmp_path, fault_env("launcher_variables_unread")),
           must=r"\{'strategy': 'ddp'\} != \{'strategy': 'zero3'\}")


def _both_launchers(engine: str, tmp_path: Path, env: dict[str, str] | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The script under `shardwise launch --config X.yaml`, then under Accelerate's launcher with
    the same file (`env`: its environment)."""
    text, _ = LAUNCH_YAMLS[engine]
    config = tmp_path / f"{engine}.yaml"
    config.write_text(COMMON_YAML + text)
    ours = _launched(["shardwise", "launch", "--config", str(config)], tmp_path / "shardwise.json")
    theirs = _launched(["accelerate.commands.launch", "--config_file", str(config)],
                       tmp_path / "accelerate.json", env)
    return ours, theirs


def check_launchers_agree(engine: str, ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    _, want = LAUNCH_YAMLS[engine]
    assert theirs["settings"] == ours["settings"], (theirs["settings"], ours["settings"])
    for key, value in want.items():
        assert ours["settings"][key] == value, (key, ours["settings"])
    ref = W.reference("llama", world=2, batch=GLOBAL // 2, accum=1, steps=STEPS)
    tol = 1e-4 if engine == "deepspeed" else 1e-5
    for run in (ours, theirs):
        assert W.close(run["losses"], ref.losses) < tol, (run["losses"], ref.losses)
        assert W.close(run["norms"], ref.norms) < tol, (run["norms"], ref.norms)
        assert W.max_diff(run["state"], ref.state) < tol
