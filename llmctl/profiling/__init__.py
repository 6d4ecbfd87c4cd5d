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


def init_kineto_on_this_thread(activities: list) -> None:
    """Start and stop a profiler once on this (the torch-importing) thread. Kineto runs its torch client's
    init on the first profiler start only if that start is on the thread that registered the client (the
    one that imported torch); from any other thread, e.g. a server's engine thread, it prints "External
    init callback must run in same thread as registerClient" on stderr, which KINETO_LOG_LEVEL does not
    silence. `profile torch` never meets this: it profiles on the main thread."""
    from torch.profiler import profile

    quiet_kineto()
    with profile(activities=activities):
        pass
