"""Starting a process that a test will Ctrl-C.

Signal dispositions set to SIG_IGN are inherited across fork and exec, and a Python child whose SIGINT
arrives ignored never installs its KeyboardInterrupt handler. In the full suite the Ctrl-C tests' children
ignored SIGINT (three tests, twice, never alone): something earlier in the pytest process left SIGINT
ignored at the C level, where `signal.getsignal` does not see it. A terminal's Ctrl-C reaches a
process with SIGINT at its default, so the tests start their children that way.
"""

from __future__ import annotations

import signal


def sigint_as_in_a_terminal() -> None:
    """`preexec_fn` for Popen: SIGINT at its default disposition and not blocked, in the child only."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
