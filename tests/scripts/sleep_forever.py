"""Joins the process group, records its pid, then waits forever (for the Ctrl-C test)."""

import os
import sys
import time
from pathlib import Path

import shardwise

engine = shardwise.Engine()
Path(sys.argv[1], f"{os.getpid()}.pid").write_text(str(engine.process_index))
while True:
    time.sleep(1)
