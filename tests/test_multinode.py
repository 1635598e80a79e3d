"""Multi-node for real: two `shardwise launch --nnodes 2 --node-rank 0/1` on this machine, 2
processes each, meeting through a c10d rendezvous on a free localhost port, with zero3 and
`shard_group_size: node`.

Asserted: both launchers exit 0 (each under a timeout: a hang fails the test, it cannot stall
CI; a gloo abort is retried once, said, only while starting: `spawn.launch_twice_at_most`);
the run equals one plain process on the same global
batches (`check_run`: losses 1e-5, clipped gradient norms 1e-5 relative, weights 2e-5), clipping
at 0.5, below every step's norm (the reference's lowest is 0.65): every step is clipped, so under
AdamW a gradient summed over the nodes instead of averaged updates the weights as the mean does
and only the norm shows it (the planted `sum_across_nodes`); and the groups that ran are the
nodes' own: every rank's sharding
group (the shard dimension of its parameters' 2-D mesh) is exactly the global ranks its
launcher started, its replica group holds one rank of each node, and it holds 1/2 of the
parameters' elements within 0.02 (its node's share; padding), not 1/4 and not all of them.

This file is also the training script the launchers run (`python tests/test_multinode.py`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as W
from planted import caught, fault_env
from spawn import free_port, launch_twice_at_most, wait_for_launchers

ROOT = Path(__file__).resolve().parents[1]
RUN = {"batch": 2, "accum": 2, "steps": 4, "clip": 0.5}  # clip: below every norm of this run
NODE_TAG = "SHARDWISE_TEST_NODE"  # set per launcher: which "node" a worker was started on
LAUNCH_TIMEOUT_S = 300  # both launchers; the run takes ~75 s on 2 shared cores


def _groups(model: torch.nn.Module) -> W.Groups:
    """The mesh every sharded parameter of `model` lives on: its (replicate, shard) groups,
    as global ranks, and the share of the parameters this rank holds."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    meshes, local, total = set(), 0, 0
    shard: list[int] = []
    replicate: list[int] = []
    for p in model.parameters():
        assert isinstance(p, DTensor), type(p)
        mesh = p.device_mesh
        meshes.add(tuple((type(x).__name__, getattr(x, "dim", None)) for x in p.placements))
        shard = dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1))
        replicate = dist.get_process_group_ranks(mesh.get_group(0)) if mesh.ndim == 2 else []
        local += p.to_local().numel()
        total += p.numel()
    return W.Groups(sorted(meshes), sorted(shard), sorted(replicate), local / total)


def _train(out: Path) -> None:
    """The worker: the loop of `workloads.run_loop` on an Engine configured by the launcher."""
    import torch.distributed as dist

    import shardwise

    engine = shardwise.Engine()
    model, opt, loader = W.prepared(engine, "tiny", batch=RUN["batch"], steps=RUN["steps"])
    trained = W.train(engine, model, opt, loader, clip=RUN["clip"])
    groups = _groups(model)
    state = engine.get_state_dict(model)  # a collective; the full weights land on rank 0
    result = W.NodeRun(
        rank=dist.get_rank(), world=engine.num_processes, node=int(os.environ[NODE_TAG]),
        local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]), groups=groups, losses=trained.losses,
        config=shardwise.config.files.to_dict(engine.config), state=state if engine.is_main_process else None,
        norms=trained.norms,
    )
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    engine.end_training()


def check_run(results: list[W.NodeRun]) -> str:
    """The 2-node run (every rank's record) against one plain process on the same global batches,
    clipping at RUN["clip"]: losses within 1e-5, the clipped steps' gradient norms within 1e-5
    relative on every rank, final weights within 2e-5. Returns what it measured."""
    ref = W.reference("tiny", world=4, **RUN)
    assert min(ref.norms) > RUN["clip"], ref.norms  # every step clipped: the norm is what tells
    main = results[0]
    assert len(main.losses) == RUN["accum"] * RUN["steps"] and len(ref.norms) == RUN["steps"]
    norm_err = max(max(abs(a - b) / b for a, b in zip(r.norms, ref.norms, strict=True)) for r in results)
    loss_err, weight_err = W.close(main.losses, ref.losses), W.max_diff(main.state, ref.state)
    said = (f"losses within {loss_err:.2e}, clipped norms within {norm_err:.2e} rel. "
            f"({main.norms[0]:.4f} vs {ref.norms[0]:.4f} at step 1), weights within {weight_err:.2e} "
            "of one process")
    assert loss_err < 1e-5, said
    assert norm_err < 1e-5, said
    assert weight_err < 2e-5, said
    return said


def _launch(out: Path, base: dict[str, str] | None = None) -> tuple[list[int | None], list[str]]:
    """Two launchers (two "nodes"), 2 workers each, all done within LAUNCH_TIMEOUT_S; past it,
    each launcher's whole session (the launcher and the workers it started) is killed. `base`:
    the launchers' environment (None: this process's)."""
    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = {**(os.environ if base is None else base), "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
               NODE_TAG: str(node)}
        env.pop("SHARDWISE_CONFIG", None)
        cmd = [sys.executable, "-m", "shardwise", "launch", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--main-address", "127.0.0.1", "--main-port", port,
               "--strategy", "zero3", "--shard-group-size", "node", "--grad-accum-steps", str(RUN["accum"]),
               "--seed", str(W.SEED), "--cpu", str(Path(__file__).resolve()), "--out", str(out)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return wait_for_launchers(procs, LAUNCH_TIMEOUT_S)


def test_two_nodes_shard_within_each_node_and_match_one_process(tmp_path: Path) -> None:
    codes, outs = launch_twice_at_most(lambda: _launch(tmp_path), "two nodes",
                                       lambda: any(tmp_path.glob("rank*.pt")))
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    ranks_of = {node: sorted(r.rank for r in results if r.node == node) for node in (0, 1)}
    assert [len(ranks_of[0]), len(ranks_of[1])] == [2, 2], ranks_of
    for res in results:
        g = res.groups
        assert res.world == 4 and res.local_world_size == 2
        assert res.config["sharding"]["shard_group_size"] == "node"
        # HSDP: every parameter on the one (replicate, shard) mesh
        assert g.meshes == [(("Replicate", None), ("Shard", 0))], g.meshes
        assert g.shard == ranks_of[res.node], (res.rank, g, ranks_of)
        assert len(g.replicate) == 2 and res.rank in g.replicate, g
        assert {results[r].node for r in g.replicate} == {0, 1}, g
        assert abs(g.share - 0.5) < 0.02, g.share  # 1/2: the node's share
    print(f"2 nodes x 2, zero3, shard_group_size node: groups {[r.groups.shard for r in results]}, "
          f"{check_run(results)}")
    assert W.max_diff(results[0].state, W.build("tiny").state_dict()) > 1e-3  # training moved the weights


def test_planted_sum_across_nodes_is_caught(tmp_path: Path) -> None:
    """`sum_across_nodes`: the gradients summed over the 2 nodes instead of averaged. The clipped
    norms double; the losses and weights, which were all the check compared before, do not move
    (asserted), since every step is clipped and AdamW sees the same clipped gradient."""
    codes, outs = _launch(tmp_path, fault_env("sum_across_nodes"))
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outs)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    ref = W.reference("tiny", world=4, **RUN)
    assert W.close(results[0].losses, ref.losses) < 1e-5  # the old check alone ...
    assert W.max_diff(results[0].state, ref.state) < 2e-5  # ... passed under the fault
    caught(check_run, results, must=r"clipped norms within 1\.00e\+00 rel\. \(\d\.\d+ vs \d\.\d+ at step 1\)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args, _unknown = parser.parse_known_args()
    _train(Path(args.out))
