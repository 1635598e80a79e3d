"""Hops through shardwise's own functions: from the user's `optimizer.step()` to the first
collective it issues, and from `engine.save_state()` to the first checkpoint file it writes.
A hop is one shardwise frame on the stack at that moment (torch's own frames not counted).

    python tools/call_hops.py [path/to/src]     # one 2-process gloo run per strategy
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

WORLD = 2


def _shardwise_frames(root: str) -> list[str]:
    frame = sys._getframe(2)
    hops = []
    while frame is not None:
        if frame.f_code.co_filename.startswith(root):
            hops.append(f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}")
        frame = frame.f_back  # type: ignore[assignment]
    return hops[::-1]


def _first(root: str, watch: Any, action: Any, modules: set[str]) -> list[str]:
    """The shardwise frames on the stack when `watch(frame)` first holds during `action()`;
    `modules` gets every shardwise module a function of which runs during it."""
    seen: list[list[str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        file = frame.f_code.co_filename
        if file.startswith(root):
            modules.add(file[len(root) + 1:-3].replace("/", "."))
        if not seen and watch(frame):
            seen.append(_shardwise_frames(root))

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return seen[0] if seen else []


def _is_collective(frame: Any) -> bool:
    # every c10d collective enters through c10d_logger's wrapper; DTensor's and FSDP2's through
    # the functional collectives
    file = frame.f_code.co_filename
    return bool((file.endswith("c10d_logger.py") and frame.f_code.co_name == "wrapper")
                or file.endswith("_functional_collectives.py"))


def _is_file_write(frame: Any) -> bool:
    # DCP's writer or the checkpoint's own files (safetensors, json, the folder's exchange)
    name, file = frame.f_code.co_name, frame.f_code.co_filename
    return (name == "write_data" and "checkpoint" in file) or (name in ("write_text", "write_bytes")
                                                               and file.endswith("pathlib.py"))


def _worker(rank: int, port: int, src: str, folder: str, out: str, strategy: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, src)
    import shardwise  # type: ignore[import-untyped]  # from `src`, as given

    root = str(Path(shardwise.__file__).parent)
    # one engine per process: a fresh pair of processes for each strategy
    engine = shardwise.Engine(strategy=strategy, seed=0, max_grad_norm=1.0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model, opt = engine.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    engine.backward(model(torch.randn(8, 16)).square().mean())
    stepped: set[str] = set()
    saved: set[str] = set()
    step = _first(root, _is_collective, opt.step, stepped)
    opt.zero_grad()
    save = _first(root, _is_file_write, lambda: engine.save_state(f"{folder}/{strategy}"), saved)
    lines = [f"{strategy}: optimizer.step() -> collective: {len(step)} hops ({' > '.join(step)}); "
             f"{len(stepped)} modules run in the step",
             f"{strategy}: save_state() -> file: {len(save)} hops ({' > '.join(save)}); "
             f"{len(saved)} modules run in the save ({', '.join(sorted(saved))})"]
    engine.end_training()
    if rank == 0:
        Path(out).write_text("\n".join(lines) + "\n")


def main() -> None:
    src = str(Path(sys.argv[1] if len(sys.argv) > 1 else "src").resolve())
    for strategy in ("zero1", "zero2", "zero3"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as folder:
            out = f"{folder}/hops.txt"
            mp.spawn(_worker, args=(port, src, folder, out, strategy), nprocs=WORLD)
            print(Path(out).read_text(), end="")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
