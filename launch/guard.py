"""``python -m launch.guard <pgid> <stop_timeout_s> [journal_dir]``: stops a TorchServe instance when its
launcher goes away, however it goes (a clean stop, a signal to the launcher alone, SIGKILL).

Started by launch/torchserve.py beside each instance, in a session of its own (a signal to the
launcher's process group does not reach it). The launcher holds the write end of the guard's stdin;
the guard blocks reading it. End of file means the launcher closed it or died: the guard sends
SIGTERM to the instance's process group, SIGKILL after ``stop_timeout_s``, and removes the
instance's journal, unless the launcher wrote ``keep`` first (a watchdog restart: the next instance
restores the sessions from that journal).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time


def stop_group(pgid: int, timeout_s: float) -> None:
    """SIGTERM the group, then SIGKILL whatever is left after ``timeout_s``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    """Any process of the group that is not a zombie (an exited child nobody reaped yet: in a
    container whose init does not reap, those linger, and signalling them succeeds)."""
    import psutil

    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def main(argv: list[str]) -> int:
    pgid, timeout_s = int(argv[0]), float(argv[1])
    journal_dir = argv[2] if len(argv) > 2 else ""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is the launcher's to handle
    message = sys.stdin.read()  # returns at end of file: the launcher closed it, or died
    stop_group(pgid, timeout_s)
    if journal_dir and "keep" not in message:
        shutil.rmtree(journal_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
