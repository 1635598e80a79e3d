"""Plants the fault named in SHARDWISE_PLANTED_FAULT at interpreter start-up (tests/planted.py).
Only on PYTHONPATH for a launched process of a planted test (`planted.fault_env`)."""

import os

if os.environ.get("SHARDWISE_PLANTED_FAULT"):
    import planted

    planted.plant(os.environ["SHARDWISE_PLANTED_FAULT"])
