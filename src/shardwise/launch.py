"""`shardwise launch` is torchrun: build its argument list (a pure function), then run it.

One node uses torchrun's standalone rendezvous. Several nodes meet through a c10d rendezvous
(torch.distributed.elastic) at main_address:main_port, hosted by node 0. Every worker gets the
one resolved config as a file path in SHARDWISE_CONFIG.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from .config import LaunchConfig
from .resilience import PREEMPTED_EXIT

CONFIG_ENV = "SHARDWISE_CONFIG"


def torchrun_argv(
    launch: LaunchConfig,
    script: str,
    script_args: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> list[str]:
    """torchrun's arguments for `launch`; `extra` holds further torchrun flags, passed as given."""
    argv = ["--nproc-per-node", str(launch.num_processes)]
    if launch.num_nodes == 1:
        argv.append("--standalone")
    elif launch.rdzv_backend == "static":
        argv += [
            "--nnodes", str(launch.num_nodes),
            "--node-rank", str(launch.node_rank),
            "--master-addr", launch.main_address,
            "--master-port", str(launch.main_port),
        ]
    else:
        argv += [
            "--nnodes", str(launch.num_nodes),
            "--node-rank", str(launch.node_rank),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{launch.main_address}:{launch.main_port}",
            "--rdzv-id", launch.rdzv_id,
            # node 0 hosts the rendezvous store; the others only connect to it
            "--rdzv-conf", f"is_host={'true' if launch.node_rank == 0 else 'false'}",
        ]
    argv += ["--max-restarts", str(launch.max_restarts), *extra, script, *script_args]
    return argv


def run_torchrun(argv: Sequence[str], config_path: str) -> int:
    """Run torchrun's elastic agent in this process; return the script's exit code.

    The agent starts the workers and stops all of them on Ctrl-C or SIGTERM (its own signal
    handling). A failed worker's exit code comes back as it was (128 + N for signal N).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ[CONFIG_ENV] = config_path
    try:
        run(parse_args(list(argv)))
    except ChildFailedError as err:
        for line in describe_failures(err.failures):
            print(f"shardwise launch: {line}", file=sys.stderr, flush=True)
        code = err.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code
    except SignalException as err:
        print(f"shardwise launch: stopped by {signal.Signals(int(err.sigval)).name}; the workers were asked to "
              f"checkpoint at their next step boundary and exit ({PREEMPTED_EXIT})", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


def describe_failures(failures: dict[int, Any]) -> list[str]:
    """One line per failed worker (torchrun's ProcessFailure), the first to fail first: its
    rank, how it ended and the first line of its error."""
    lines = []
    for rank, f in sorted(failures.items(), key=lambda item: item[1].timestamp):
        code = f.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        if code == PREEMPTED_EXIT:
            how += " (stopped after a checkpoint: preempted, or its launcher went away)"
        elif code == -signal.SIGABRT:
            how += (" (if that was while the process group connected, it is gloo's start-up abort; "
                    "--max-restarts 1 restarts the group by itself)")
        first = _first_error_line(f.error_file)
        lines.append(f"rank {rank} (local rank {f.local_rank}, pid {f.pid}) {how}" + (f": {first}" if first else ""))
    return lines


def _first_error_line(path: str | None) -> str:
    """The message torchrun's error file holds for a worker that raised (empty if none)."""
    try:
        with open(path or "") as fh:
            data = json.load(fh)
        message = data.get("message", {})
        text = message.get("message", "") if isinstance(message, dict) else str(message)
    except (OSError, ValueError, AttributeError):
        return ""
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""
