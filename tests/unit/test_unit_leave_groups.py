"""The end of a run leaves its process groups so that gloo's threads never free a collective while
the interpreter finalizes (`distributed.world.leave_process_groups`).

The abort this prevents ("terminate called without an active exception", SIGABRT after training
had finished) needs a descheduled gloo thread at interpreter exit, so a test can only make it
likely, not certain: under load it hit 2 of 29 launched 2-process runs before the fix and 0 of 44
after. What is checked here, in a fresh interpreter each, is the mechanism: every gloo group of
the process gets a last barrier, the barriers are held to the end of the process, the groups are
gone, and the process then exits 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from shardwise.distributed import world

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    extra = dist.new_group(backend="gloo")
    for group in (None, extra):  # collectives on temporaries, their Python tensors gone at once
        work = dist.all_reduce(torch.ones(1000), group=group, async_op=True)
        work.wait()
        del work
    world.leave_process_groups()
    assert not dist.is_initialized()
    assert len(world._FINAL_BARRIERS) == 2, world._FINAL_BARRIERS  # the default group's and extra's
    world.leave_process_groups()  # a second call (a second engine's end) does nothing
    assert len(world._FINAL_BARRIERS) == 2
    print("left")
""")


def test_every_gloo_group_gets_a_held_last_barrier_and_the_process_exits_cleanly() -> None:
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == "left"
        assert "terminate called" not in proc.stderr
