"""`shardwise plan`: its flags, and the command that plans and prints (the planner is `shardwise.plan`)."""

from __future__ import annotations

import argparse
from typing import Any

from ..config.tree import PRECISIONS, ConfigError

_MODELS_HELP = ("a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, deberta-v2-xlarge, blenderbot-400m, "
                "llama-1b, llama-7b), a config.json, or module:factory")


def add_plan_parser(sub: Any) -> argparse.ArgumentParser:
    """The `plan` subcommand and its flags, added to the subcommands `sub`."""
    p: argparse.ArgumentParser = sub.add_parser(
        "plan",
        help="which strategy and per-device batch fit, predicted from a trace on fake tensors",
        description="Trace the model through every strategy on fake tensors (nothing is allocated, no "
                    "GPU needed) and report, per strategy without and with activation checkpointing (or "
                    "with the mode --activation-checkpointing names), the "
                    "per-device peak memory and its parts, the largest batch that fits and the relative "
                    "step time; the fastest plan that fits is marked. Memory sizes are binary: "
                    "24GB = 24 GiB.",
    )
    p.add_argument("--model", required=True, help=_MODELS_HELP)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=1, help="per-device batch to evaluate (default 1)")
    p.add_argument("--gpus", type=int, default=None,
                   help="devices (processes) to plan for, all nodes together (default 1, or "
                        "--nodes x --gpus-per-node)")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes the devices spread over (default 1); with 2 or more the table also plans "
                        "hybrid sharding (shard within a node, replicate across nodes) and splits each "
                        "plan's communication into bytes within a node and across nodes")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="devices per node (default: --gpus / --nodes)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="also plan every strategy and offload with tensor parallelism over N devices of a "
                        "node (N divides the devices per node; the model needs a tensor-parallel plan; "
                        "default 1: none)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="plan the tensor-parallel plans with sequence parallelism (the activations between "
                        "the split layers split over the sequence too)")
    p.add_argument("--context-parallel-size", type=int, default=1, metavar="N",
                   help="plan every strategy with each sequence split over N devices (context parallelism: "
                        "each traced on its --seq-len / N tokens, tiled MLP and loss on), and report the "
                        "longest sequence each plan fits")
    p.add_argument("--expert-parallel-size", type=int, default=1, metavar="N",
                   help="also plan zero1, zero2 and zero3 with every mixture-of-experts layer's experts "
                        "split over N devices (expert parallelism; traced with even routing: the all-to-all "
                        "bytes and the experts each device holds; default 1: none)")
    p.add_argument("--gpu-memory", default=None,
                   help="memory of one device, e.g. 24GB (default: this machine's GPU 0)")
    p.add_argument("--cpu-memory", default=None,
                   help="host memory of the machine; offload plans must fit in it")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    p.add_argument("--activation-checkpointing", nargs="?", const="full", default=None,
                   choices=["none", "full", "selective", "offload"], metavar="{none,full,selective,offload}",
                   help="plan every strategy with this activation-checkpointing mode only (alone: full; "
                        "default: without and with full)")
    p.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_const",
                   const="none", help="only plans without activation checkpointing (= none)")
    p.add_argument("--activation-checkpointing-every", type=int, default=None, metavar="K",
                   help="with selective: every K-th block in full, instead of keeping matmul outputs")
    p.add_argument("--checkpoint-async", action="store_true",
                   help="count the host copy a background checkpoint holds (checkpoint_async)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="suggest per-device batch x accumulation steps for this global batch")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="plan for GPUs (default) or CPU processes")
    p.add_argument("--cuda-context", default=None,
                   help="device memory outside tensors: CUDA context and workspaces (default 0.6GB)")
    p.add_argument("--nccl-buffers", default=None,
                   help="NCCL buffers per process with 2+ devices (default 0.4GB)")
    p.add_argument("--fragmentation", type=float, default=None,
                   help="allocator fragmentation, fraction of the tensor peak (default 0.08)")
    p.add_argument("--write", metavar="YAML", default=None,
                   help="save the chosen plan as a config for shardwise launch")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="draw the breakdown as stacked bars per plan (needs matplotlib)")
    p.add_argument("--workers", type=int, default=2, help="processes tracing in parallel (default 2)")
    return p


def world_layout(gpus: int | None, nodes: int | None, per_node: int | None) -> tuple[int, int]:
    """(devices, nodes) from --gpus, --nodes and --gpus-per-node; an inconsistent combination is
    refused in one line."""
    for flag, value, what in (("--gpus", gpus, "device"), ("--nodes", nodes, "node"),
                              ("--gpus-per-node", per_node, "device per node")):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: plan for at least 1 {what}")
    n = 1 if nodes is None else nodes
    if per_node is None:
        world = 1 if gpus is None else gpus
        if world % n:
            raise ConfigError(f"--gpus {world} does not spread evenly over --nodes {n}")
        return world, n
    if gpus is not None and gpus != n * per_node:
        raise ConfigError(f"--gpus {gpus} disagrees with --nodes {n} x --gpus-per-node {per_node} "
                          f"= {n * per_node}; give one or the other")
    return n * per_node, n


def _device_memory(ns: argparse.Namespace) -> int | str:
    """--gpu-memory, else this machine's GPU 0's memory."""
    if ns.gpu_memory is not None:
        return str(ns.gpu_memory)
    import torch

    if ns.device == "cpu" or not torch.cuda.is_available():
        raise ConfigError("--gpu-memory is needed (no GPU here to read it from), e.g. --gpu-memory 24GB")
    return int(torch.cuda.get_device_properties(0).total_memory)


def _overheads(ns: argparse.Namespace) -> Any:
    """The stated overheads, each flag overriding its default."""
    from ..plan import Overheads, parse_memory

    base = Overheads()
    context, nccl = base.cuda_context, base.nccl_buffers
    if ns.cuda_context:
        context = parse_memory(ns.cuda_context, "--cuda-context")
    if ns.nccl_buffers:
        nccl = parse_memory(ns.nccl_buffers, "--nccl-buffers")
    fragmentation = base.fragmentation if ns.fragmentation is None else ns.fragmentation
    overheads = Overheads(cuda_context=context, nccl_buffers=nccl, fragmentation=fragmentation)
    if not 0 <= overheads.fragmentation < 1:
        raise ConfigError(f"--fragmentation {ns.fragmentation}: must lie in [0, 1)")
    return overheads


def run_plan(ns: argparse.Namespace) -> int:
    """`shardwise plan`: plan, print the table, and write the plot and the config if asked."""
    from ..plan import PlanRequest, plan_named
    from ..plan.report import describe, plot, write_config

    world, nodes = world_layout(ns.gpus, ns.nodes, ns.gpus_per_node)
    memory = _device_memory(ns)
    request = PlanRequest(
        world_size=world, nodes=nodes, device_memory=memory, batch=ns.batch, workers=max(1, ns.workers),
        device=ns.device, precision=ns.precision, host_memory=ns.cpu_memory,
        activation_checkpointing=ns.activation_checkpointing,
        activation_checkpointing_every=ns.activation_checkpointing_every, global_batch=ns.global_batch,
        overheads=_overheads(ns), checkpoint_async=ns.checkpoint_async,
        tensor_parallel_size=ns.tensor_parallel_size, sequence_parallel=ns.sequence_parallel,
        context_parallel_size=ns.context_parallel_size, expert_parallel_size=ns.expert_parallel_size,
    )
    result = plan_named(ns.model, request, seq_len=ns.seq_len)
    print(describe(result))
    if ns.plot:
        plot(result, ns.plot)
        print(f"wrote {ns.plot}")
    if ns.write:
        write_config(result, ns.write)
        print(f"wrote {ns.write}")
    return 0
