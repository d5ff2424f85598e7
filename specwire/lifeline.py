"""Children that stop when their parent dies, however it dies (`specwire up`, `bench`, `demo`).

The parent makes a pipe and keeps its write end to itself; each child inherits the read end and
watches it on a thread. The kernel closes a process's descriptors when it ends, by SIGKILL too,
so the child reads end-of-file the moment the parent is gone, and stops as on SIGTERM.

A pipe rather than Linux's PR_SET_PDEATHSIG: the death signal follows the *thread* that forked
the child (a restart spawned from a thread that later ends would kill a healthy child), it would
need `preexec_fn`, which is unsafe in a process with threads, and it exists on Linux only. A
child started when the parent has already died reads end-of-file at once, so there is no race.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Mapping

log = logging.getLogger("specwire")
# The read end's descriptor number, in the child's environment.
ENV = "SPECWIRE_LIFELINE_FD"


class Lifeline:
    """The parent's side: one pipe for all its children. Only this process holds the write end
    (os.pipe's descriptors are not inherited unless passed)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()

    def child_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """A child's environment, naming the read end; start it with `pass_fds=(read_fd,)`."""
        return {**env, ENV: str(self.read_fd)}

    def close(self) -> None:
        """Children still running see end-of-file, and stop."""
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)


def watch_parent() -> None:
    """In a child started with a lifeline: SIGTERM this process once the parent is gone. The
    variable is removed so that this process's own children do not take a number that names
    nothing of theirs for a lifeline."""
    value = os.environ.pop(ENV, None)
    if value is None:
        return
    fd = int(value)

    def wait() -> None:
        try:
            while os.read(fd, 1):  # nothing is ever written: this returns b"" at the parent's end
                pass
        except OSError as error:
            log.warning("lifeline fd %d unreadable (%s): not watching the parent", fd, error)
            return
        log.warning("the parent process is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, daemon=True, name="lifeline").start()
