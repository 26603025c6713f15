"""TorchServe handler: a thin adapter from TorchServe's contract to ``session.serving.api.ChatService``.

Runs with ``asyncCommunication: true`` and ``batchSize: 1``: TorchServe hands every request to
``handle`` as soon as it arrives, while the engine thread batches the requests of all sessions
in one forward pass. Mitigations for that mode's known faults (docs/DESIGN.md, "TorchServe as we found it"):
- a successful answer is sent as one streamed chunk (a plain one leaks a frontend job entry);
- errors are sent plain, with their 4xx/5xx status;
- nothing escapes ``handle`` (an escaping exception answers 503 to every request in flight);
- writes to the frontend socket are serialised (chunks and final responses go out from two threads).
"""

import json
import logging
import os
import threading
import time
import traceback

from ts.handler_utils.utils import send_intermediate_predict_response
from ts.metrics.metric_type_enum import MetricTypes

from session.config import EngineConfig
from session.engine import Engine
from session.serving.api import ApiResponse, ChatService, error_response
from session.serving.protocol import form_body_error, header

logger = logging.getLogger(__name__)
METRICS_REFRESH_S = 1.0  # how often the engine's stats are emitted again (when they changed)


class ResidentHandler:
    def __init__(self):
        self.service = None
        self.initialized = False
        self._locked_socket = None
        self.metrics = None
        self._emitted = {}  # counter key -> value last emitted (TorchServe counters take increments)
        self._emitted_stats = None  # the EngineStats last emitted
        self._metrics_lock = threading.Lock()  # requests' threads and the refresher emit

    def initialize(self, context):
        """Called by TorchServe once per worker process. Whatever raises here is also written to
        RESIDENT_INIT_ERROR_FILE: TorchServe only logs it and starts the worker again, forever, so the
        launcher (launch/torchserve.py ``wait_ready``) stops at that file instead."""
        try:
            props = context.system_properties
            section = (context.model_yaml_config or {}).get("handler", {})
            config = EngineConfig.from_sources(section, os.environ, base_dir=props.get("model_dir"))
            engine = Engine(config).start()
            engine.warmup()
        except Exception as exc:
            _record_init_failure(exc, os.environ.get("RESIDENT_INIT_ERROR_FILE"))
            raise
        self.service = ChatService(engine, model_name=context.model_name)
        self.metrics = context.metrics
        threading.Thread(target=self._refresh_metrics, name="resident-metrics", daemon=True).start()
        logger.info("resident engine ready: model %s on %s", config.model_path, engine.parts.runner.device)
        self.initialized = True

    async def handle(self, data, context):
        if self._locked_socket is None:
            self._locked_socket = _serialise_socket_writes()
        if self._locked_socket is not None:
            context.cl_socket = self._locked_socket
        started = time.perf_counter()
        kind = "error"
        try:
            row = data[0]
            body = row.get("body") if row.get("body") is not None else row.get("data")
            headers = context.get_all_request_header(0)
            form_error = form_body_error(header(headers, "Content-Type"))
            if body is None and form_error is not None:  # TorchServe decoded it as a form: the JSON is lost
                return self._plain(error_response(form_error), context)
            response = await self.service.invoke(headers, body)
            kind = response.kind
            return await self._send(response, context)
        except Exception as exc:  # our fault; answer this request only
            response = error_response(exc, context.get_request_id(0) or "")
            return self._plain(response, context)
        finally:
            self._emit_metrics(kind, time.perf_counter() - started)

    async def _send(self, response: ApiResponse, context):
        if response.status != 200:
            return self._plain(response, context)
        self._set_headers(response, context)
        if response.chunks is None:
            self._chunk(json.dumps(response.body), context)
        else:
            async for chunk in response.chunks:
                self._chunk(chunk, context)
        return [""]

    def _plain(self, response: ApiResponse, context):
        self._set_headers(response, context)
        return [json.dumps(response.body)]

    def _emit_metrics(self, kind: str, latency_s: float) -> None:
        """A request's latency, and the engine's stats, as TorchServe model metrics (declared in
        model_store/metrics.yaml). The latency is in seconds: TorchServe's Prometheus histograms take the
        client library's default buckets, 5 ms to 10 s."""
        try:
            dims = [self.service.model_name, "Model"]
            self._metric("RequestLatencySeconds", MetricTypes.HISTOGRAM).add_or_update(latency_s, dims + [kind])
        except Exception:  # metrics must never fail a request
            logger.exception("emitting metrics failed")
        self._emit_stats()

    def _refresh_metrics(self) -> None:
        """The stats again every METRICS_REFRESH_S, on a thread of its own. A request that ends may read
        stats the engine published before it let that request go (still running, its blocks pinned),
        and an idle server's sessions expire with no request to emit the change."""
        while True:
            time.sleep(METRICS_REFRESH_S)
            self._emit_stats()

    def _emit_stats(self) -> None:
        """The engine's stats as gauges and counters, when they changed since they were last emitted."""
        try:
            with self._metrics_lock:
                stats = self.service.engine.stats()
                if stats == self._emitted_stats:
                    return
                self._emit_snapshot(stats, [self.service.model_name, "Model"])
                self._emitted_stats = stats
        except Exception:  # metrics must never fail a request, nor end the refresher
            logger.exception("emitting metrics failed")

    def _emit_snapshot(self, stats, dims: list[str]) -> None:
        self._metric("LiveSessions", MetricTypes.GAUGE).add_or_update(stats.live_sessions, dims)
        self._metric("RunningRequests", MetricTypes.GAUGE).add_or_update(stats.running_requests, dims)
        self._metric("DeviceBudgetBytes", MetricTypes.GAUGE).add_or_update(stats.device_budget_bytes, dims)
        self._metric("NotRecoverableSessions", MetricTypes.GAUGE).add_or_update(stats.not_recoverable_sessions, dims)
        for tier, count in stats.sessions_by_tier.items():
            self._metric("SessionsByTier", MetricTypes.GAUGE).add_or_update(count, dims + [tier])
        for tier, count in stats.resident_bytes.items():
            self._metric("ResidentBytes", MetricTypes.GAUGE).add_or_update(count, dims + [tier])
        for name, counts in (("SessionEvents", stats.events), ("Tokens", stats.tokens),
                             ("Speculation", stats.speculation), ("RequestOutcomes", stats.requests)):
            for key, total in counts.items():
                delta = total - self._emitted.get((name, key), 0)
                if delta:
                    self._metric(name, MetricTypes.COUNTER).add_or_update(delta, dims + [key])
                    self._emitted[(name, key)] = total

    def _metric(self, name, metric_type):
        return self.metrics.get_metric(name, metric_type)

    @staticmethod
    def _set_headers(response: ApiResponse, context):
        context.set_response_status(response.status)
        context.set_response_content_type(0, response.content_type)
        for name, value in response.headers.items():
            context.set_response_header(0, name, value)

    @staticmethod
    def _chunk(text: str, context):
        send_intermediate_predict_response([text], context.request_ids, "Intermediate Prediction success", 200,
                                           context)


def _record_init_failure(exc: Exception, path: str | None) -> None:
    """Write ``exc`` where the launcher looks: its one-line summary, then the traceback. Written whole
    (a temp file renamed into place), because the launcher polls the file while it is written."""
    if not path:  # not started by our launcher
        return
    summary = " ".join(f"{type(exc).__name__}: {exc}".split())
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temp, "w") as out:
            out.write(summary + "\n\n" + "".join(traceback.format_exception(exc)))
        os.replace(temp, path)
    except OSError:  # the worker's own exception is the one to raise; the launcher then times out
        logger.exception("cannot write %s", path)


def _serialise_socket_writes():
    """Make the frontend socket's ``sendall`` hold a lock. Called on the first request.

    TorchServe's AsyncService writes final responses from its own thread via ``service.cl_socket``
    while intermediate chunks are written from the handler's event loop; unlocked, large frames
    interleave. The AsyncService exists only after ``initialize`` and is reachable only through
    the garbage collector.
    """
    import gc

    from ts.async_service import AsyncService

    class LockedSocket:  # local: TorchServe wants exactly one class defined in a handler module
        def __init__(self, sock):
            self._sock = sock
            self._lock = threading.Lock()

        def sendall(self, data):
            with self._lock:
                return self._sock.sendall(data)

        def __getattr__(self, name):
            return getattr(self._sock, name)

    for obj in gc.get_objects():
        if isinstance(obj, AsyncService):
            if type(obj.service.cl_socket).__name__ != "LockedSocket":
                obj.service.cl_socket = LockedSocket(obj.service.cl_socket)
            return obj.service.cl_socket
    return None
