"""Row readers for the model list's scan tests, module-level so the scan's worker process can import them."""
from __future__ import annotations

import time
from pathlib import Path

from app.model_scan import read_row


def read_slowly(p: Path, budget):
    """A file named aaa-slow*.gguf reads for ten minutes (the worker must be killed, not waited on)."""
    if p.name.startswith("aaa-slow"):
        time.sleep(600)
    return read_row(p, budget)
