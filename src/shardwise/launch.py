"""`shardwise launch` is torchrun: build its argument list (a pure function), then run it.

One node uses torchrun's standalone rendezvous. Several nodes meet through a c10d rendezvous
(torch.distributed.elastic) at main_address:main_port, hosted by node 0. Every worker gets the
one resolved config as a file path in SHARDWISE_CONFIG.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

from .config import LaunchConfig

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
        code = err.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code
    except SignalException as err:
        return 128 + int(err.sigval)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0
