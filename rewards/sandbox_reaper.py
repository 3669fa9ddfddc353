"""The ``audit`` mode's stand-in for a PID namespace (:mod:`rewards.sandbox_modes`): a parent process, sent as
source to ``python -I -S -B -c``, that makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux 3.4), runs
its arguments as its child and, when that child ends or a ``SIGTERM`` arrives, kills every process left below it:
orphans of the program (``setsid``, a new process group, ``_posixsubprocess.fork_exec``) are re-parented to it,
not to the host's init. Exits with the child's code (a signal as ``128 + signo``). A program that kills this
process first escapes it: the ``audit`` mode contains nothing against a program that tries (refused by default).
"""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def _kill_below() -> None:
    """SIGKILL every child of this process (orphans land here) until none is left, reaping each."""
    me = os.getpid()
    while True:
        try:
            with open(f"/proc/{me}/task/{me}/children") as fh:
                children = [int(pid) for pid in fh.read().split()]
        except OSError:
            children = []
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # ended while listed
        try:
            os.waitpid(-1, 0)  # one at a time: an orphan of a killed child arrives here next
        except ChildProcessError:
            return


def main():
    """Run ``sys.argv[1:]`` as the child, then clear what it left (see the module docstring)."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"sandbox reaper: prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    child = subprocess.Popen(sys.argv[1:], close_fds=False)  # the judge's protocol descriptors go to its child
    os.closerange(0, 2)  # this process keeps no end of the pipes (an end kept here would hide the child's exit)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))

    def stop(signum, frame):
        _kill_below()
        os._exit(128 + signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    code = child.wait()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up below finishes even if the parent asks again
    _kill_below()
    os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
