import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

if os.environ.get("SHARDWISE_TOLERANCE_RECORD"):  # the tolerance sweep (tests/tolerances.py)
    import tolerances

    tolerances.install()

    def pytest_assertion_pass(item: object, lineno: int, orig: str, expl: str) -> None:
        tolerances.assertion_passed(orig, expl, f"{getattr(item, 'fspath', '?')}:{lineno}".rsplit("/", 1)[-1])
