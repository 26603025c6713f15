"""Keeps a TorchServe instance answering: restart it when its worker stops serving.

TorchServe 0.12 does not restart an ``asyncCommunication`` worker that died (DESIGN §5): the
model stays "UNLOADING" and requests hang. Re-registering the model brings a worker back but
loses TorchServe's default model for ``/invocations``, so the watchdog restarts the whole
instance instead (same ports, same journal): live sessions come back from the journal and
their next follow-up is recomputed. The probe is a real inference (stateless, one token); a
503 from our admission control counts as alive, so load never triggers a restart.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request

from launch.torchserve import MODEL_NAME, TorchServe

logger = logging.getLogger(__name__)

PROBE_BODY = json.dumps({"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}).encode()


class Watchdog:
    def __init__(self, server: TorchServe, *, interval_s: float = 5.0, failures_to_restart: int = 3,
                 probe_timeout_s: float = 30.0, ready_timeout_s: float = 600.0):
        self.server = server
        self.interval_s = interval_s
        self.failures_to_restart = failures_to_restart
        self.probe_timeout_s = probe_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.num_failures = 0  # consecutive failed probes
        self._stop = threading.Event()
        self._restarting = threading.Lock()  # held while the server is replaced: stop() waits for it
        self._thread = threading.Thread(target=self._run, name="resident-watchdog", daemon=True)

    def start(self) -> "Watchdog":
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
        """True when the worker is READY and answers a real inference (200, or 503 when busy)."""
        if self.server.worker_statuses() != ["READY"]:
            return False
        request = urllib.request.Request(f"{self.server.url}/predictions/{MODEL_NAME}", data=PROBE_BODY,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.probe_timeout_s) as response:
                return response.status == 200
        except urllib.error.HTTPError as exc:
            return exc.code == 503
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def _run(self) -> None:
        try:  # a model still loading is not a failure
            self.server.wait_ready(self.ready_timeout_s)
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
            except Exception:
                logger.exception("restarting TorchServe on port %d failed; will retry", self.server.port)
            self.num_failures = 0


def watch(server: TorchServe, environ) -> Watchdog | None:
    """A started watchdog for ``server`` per RESIDENT_WATCHDOG_INTERVAL_S (default 5; 0 disables)
    and RESIDENT_WATCHDOG_FAILURES (consecutive failed probes before a restart, default 3)."""
    interval = float(environ.get("RESIDENT_WATCHDOG_INTERVAL_S", "5"))
    if interval <= 0:
        return None
    return Watchdog(server, interval_s=interval,
                    failures_to_restart=int(environ.get("RESIDENT_WATCHDOG_FAILURES", "3"))).start()
