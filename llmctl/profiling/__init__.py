"""Profiling behind `llmctl profile`: py-spy, memray, torch.profiler and leak hunting."""

from __future__ import annotations

import os

# Kineto, torch.profiler's C++ side, writes `STAGE:`/`USDT: ... profiler_start` lines (and on CPU-only
# hosts `ERROR:` lines about CUPTI) to stderr on every start and stop, whatever Python's logging
# says. 6 is above its highest level (USDT); failures still raise in Python. Read at its first start.
KINETO_QUIET_LEVEL = "6"


def quiet_kineto() -> None:
    """Silence kineto's stderr lines for this process, unless the user set KINETO_LOG_LEVEL."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)
