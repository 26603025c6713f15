"""Keeps a TorchServe instance answering: restart it when its worker is dead or stuck, never when busy.

TorchServe 0.12 does not restart an ``asyncCommunication`` worker that died (the model stays
"UNLOADING" and requests hang). Re-registering the model brings a worker back but loses
TorchServe's default model for ``/invocations``, so the watchdog restarts the whole instance
instead (same ports, same journal): live sessions come back from the journal and their next
follow-up is recomputed.

Liveness is read out of band, never by queueing behind requests: the worker must be READY in the
management API and the engine loop's heartbeat file (touched every iteration, at least once a
second, see session/engine/loop.py) must be fresher than ``stall_s``. A saturated engine still turns its
loop every step, so load never looks like a failure; a dead worker (no READY) or a loop stuck in
one step for longer than ``stall_s`` does. A worker that raises in ``initialize`` (WorkerInitError,
at start or after a restart) is never restarted: the same checkpoint and settings would fail the
same way, so the watchdog stops watching and the launcher, which polls the same file, stops the launch.
"""

from __future__ import annotations

import logging
import threading

from launch.torchserve import TorchServe, WorkerInitError

logger = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, server: TorchServe, *, interval_s: float = 5.0, failures_to_restart: int = 3,
                 stall_s: float = 60.0, ready_timeout_s: float = 600.0):
        self.server = server
        self.interval_s = interval_s
        self.failures_to_restart = failures_to_restart
        self.stall_s = stall_s
        self.ready_timeout_s = ready_timeout_s
        self.num_failures = 0  # consecutive failed probes
        self._stop = threading.Event()
        self._restarting = threading.Lock()  # held while the server is replaced: stop() waits for it
        self._thread = threading.Thread(target=self._run, name="resident-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Called before the server is stopped: no restart is under way or can start after this returns
        (a probe still in flight just fails: the thread is a daemon)."""
        self._stop.set()
        with self._restarting:
            pass
        self._thread.join(2.0)

    def probe(self) -> bool:
        """True when the worker is READY and its engine loop turned within ``stall_s``."""
        if self.server.worker_statuses() != ["READY"]:
            return False
        age = self.server.heartbeat_age_s()
        return age is not None and age <= self.stall_s

    def _run(self) -> None:
        try:  # a model still loading is not a failure
            self.server.wait_ready(self.ready_timeout_s)
        except WorkerInitError as exc:  # a restart would fail the same way: the launcher stops instead
            logger.error("TorchServe on port %d: %s; not watching it", self.server.port, exc)
            return
        except Exception:
            logger.warning("TorchServe on port %d not ready at start; probing anyway", self.server.port)
        while not self._stop.wait(self.interval_s):
            if self.server.process.poll() is not None and self._stop.is_set():
                return
            self.num_failures = 0 if self.probe() else self.num_failures + 1
            if self.num_failures < self.failures_to_restart or self._stop.is_set():
                continue
            logger.warning("TorchServe on port %d failed %d probes: restarting it", self.server.port,
                           self.num_failures)
            try:
                with self._restarting:
                    if self._stop.is_set():
                        return
                    self.server.restart()
                self.server.wait_ready(self.ready_timeout_s)
            except WorkerInitError as exc:
                logger.error("restarting TorchServe on port %d failed: %s; not restarting it again",
                             self.server.port, exc)
                return
            except Exception:
                logger.exception("restarting TorchServe on port %d failed; will retry", self.server.port)
            self.num_failures = 0


def watch(server: TorchServe, environ) -> Watchdog | None:
    """A started watchdog for ``server`` per RESIDENT_WATCHDOG_INTERVAL_S (default 5; 0 disables),
    RESIDENT_WATCHDOG_FAILURES (consecutive failed probes before a restart, default 3) and
    RESIDENT_WATCHDOG_STALL_S (a heartbeat older than this is a stuck loop, default 60)."""
    interval = float(environ.get("RESIDENT_WATCHDOG_INTERVAL_S", "5"))
    if interval <= 0:
        return None
    return Watchdog(server, interval_s=interval,
                    failures_to_restart=int(environ.get("RESIDENT_WATCHDOG_FAILURES", "3")),
                    stall_s=float(environ.get("RESIDENT_WATCHDOG_STALL_S", "60"))).start()
