import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

if os.environ.get("SHARDWISE_TOLERANCE_RECORD"):  # the tolerance sweep (tests/tolerances.py)
    import tolerances

    tolerances.install()

    def pytest_assertion_pass(item: object, lineno: int, orig: str, expl: str) -> None:
        tolerances.assertion_passed(orig, expl, f"{getattr(item, 'fspath', '?')}:{lineno}".rsplit("/", 1)[-1])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The collectives spawned workers called, each checked against NCCL's rules (tests/audit.py)."""
    import audit

    if audit.TOTAL:
        kinds = ", ".join(f"{name} {n}" for name, n in audit.TOTAL.most_common())
        terminalreporter.write_line(f"collective auditor: {sum(audit.TOTAL.values())} collectives checked "
                                    f"against NCCL's rules in spawned workers ({kinds})")
