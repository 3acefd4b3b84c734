"""Prometheus metrics of the server (`GET /metrics`).

Every HTTP request is counted once, with its status, by the RequestCounter middleware; the
other counters and histograms are updated as requests finish; per-stage gauges (queue depth, running
requests, batch size, KV blocks) are read from the runtime's `stats()` at scrape time, so they
are never stale; so are the per-replica series of replicated stages (`replica_stats()`,
labelled {stage, replica}). Each server has its own registry (several apps can live in one
process)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omnistage.outputs import OmniRequestOutput
from omnistage.runtime.replicas import unit_name

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)
TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)

# stage stats key -> (metric name, help, kind)
_STAGE_GAUGES = {
    "queue": ("omnistage_stage_queue_depth", "Requests waiting in the stage"),
    "running": ("omnistage_stage_running_requests", "Requests running in the stage"),
    "batch_size": ("omnistage_stage_batch_size", "Requests in the stage's last step"),
    "free_kv_blocks": ("omnistage_stage_kv_blocks_free", "Free KV cache blocks"),
    "kv_blocks": ("omnistage_stage_kv_blocks_total", "KV cache blocks"),
    "captures_pending": ("omnistage_stage_graph_captures_pending", "CUDA graphs a lazy warm-up "
                         "(--warmup-plan lazy) left to capture while the runtime is idle"),
}
_STAGE_COUNTERS = {
    "busy_seconds": ("omnistage_stage_busy_seconds", "Seconds the stage spent stepping"),
    "steps": ("omnistage_stage_steps", "Engine steps"),
    "ahead_steps": ("omnistage_stage_ahead_steps",
                    "Engine steps launched before the previous step's tokens were read"),
    "prefix_cache_hit_tokens": ("omnistage_stage_prefix_cache_hit_tokens",
                                "Prompt tokens served from the prefix cache"),
    "preemptions": ("omnistage_stage_preemptions", "Requests preempted for KV space"),
}

# a replicated stage's replicas (runtime/replicas.py: ReplicaSet.replica_stats), labelled
# {stage, replica}; stats key -> (metric name, help)
_REPLICA_GAUGES = {
    "holding": ("omnistage_replica_requests_in_flight", "Requests the replica holds now"),
    "queue": ("omnistage_replica_queue_depth", "Requests waiting in the replica"),
    "running": ("omnistage_replica_running_requests", "Requests running in the replica"),
    "batch_size": ("omnistage_replica_batch_size", "Requests in the replica's last step"),
    "alive": ("omnistage_replica_up", "1 while the replica's process or Ray actor is alive"),
}
_REPLICA_COUNTERS = {
    "routed": ("omnistage_replica_requests_routed", "Requests routed to the replica"),
    "finished": ("omnistage_replica_requests_finished", "Requests that finished on the replica"),
    "failed": ("omnistage_replica_requests_failed",
               "Requests that ended on the replica with an error"),
    "aborted": ("omnistage_replica_requests_aborted", "Requests dropped from the replica before "
                "they finished there (client gone, timeout, failure elsewhere, replica lost)"),
    "busy_seconds": ("omnistage_replica_busy_seconds", "Seconds the replica spent stepping"),
    "steps": ("omnistage_replica_steps", "Engine steps of the replica"),
    "restarts": ("omnistage_replica_restarts", "Times the replica's process or actor was "
                 "started again after it died"),
}


def _replica_families(runtime) -> list:
    """Per-replica series of every stage with more than one replica."""
    gauges = {k: GaugeMetricFamily(n, h, labels=["stage", "replica"]) for k, (n, h) in
              _REPLICA_GAUGES.items()}
    counters = {k: CounterMetricFamily(n, h, labels=["stage", "replica"]) for k, (n, h) in
                _REPLICA_COUNTERS.items()}
    errors = CounterMetricFamily("omnistage_replica_errors", "Step crashes of the replica "
                                 "(its requests failed, the replica went on or was restarted)",
                                 labels=["stage", "replica"])
    for stage, replicas in runtime.replica_stats().items():
        if len(replicas) < 2:
            continue
        for r, s in enumerate(replicas):
            labels = [stage, str(r)]
            for key, value in s.items():
                if key in gauges:
                    gauges[key].add_metric(labels, float(value))
                elif key in counters:
                    counters[key].add_metric(labels, float(value))
            unit = unit_name(stage, r, len(replicas))
            errors.add_metric(labels, float(runtime.unit_errors.get(unit, 0)))
    return [*gauges.values(), *counters.values(), errors]


class _RuntimeCollector:
    """Reads the runtime's per-stage stats at scrape time."""

    def __init__(self, llm, in_flight) -> None:
        self.llm, self.in_flight = llm, in_flight

    def collect(self):
        runtime = self.llm.runtime
        stats = runtime.stats()
        gauges = {k: GaugeMetricFamily(n, h, labels=["stage"]) for k, (n, h) in
                  _STAGE_GAUGES.items()}
        counters = {k: CounterMetricFamily(n, h, labels=["stage"]) for k, (n, h) in
                    _STAGE_COUNTERS.items()}
        errors = CounterMetricFamily("omnistage_stage_errors", "Stage crashes (restarted)",
                                     labels=["stage"])
        for stage, s in stats.items():
            for key, value in s.items():
                if key in gauges:
                    gauges[key].add_metric([stage], float(value))
                elif key in counters:
                    counters[key].add_metric([stage], float(value))
            errors.add_metric([stage], float(runtime.stage_errors.get(stage, 0)))
        yield from gauges.values()
        yield from counters.values()
        yield errors
        yield from _replica_families(runtime)
        yield GaugeMetricFamily("omnistage_runtime_requests", "Requests inside the runtime",
                                value=float(runtime.num_active()))
        yield GaugeMetricFamily("omnistage_server_requests_in_flight",
                                "HTTP generation requests in flight", value=float(self.in_flight()))


class ServerMetrics:
    def __init__(self, llm, in_flight) -> None:
        """`in_flight`: a callable giving the number of generation requests in flight."""
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "omnistage_http_requests", "HTTP requests (all but /health and /metrics) by endpoint "
            "and status: 'ok' (answered 200 in full), 'error' (failed after its 200 status line: "
            "a stream's error event), else the HTTP status code ('400', '429', '499': the client "
            "went away, '500', ...)", ["endpoint", "status"], registry=r)
        self.aborted = Counter("omnistage_requests_aborted", "Requests aborted because the "
                               "client went away", ["endpoint"], registry=r)
        self.rejected = Counter("omnistage_requests_rejected", "Requests refused with 429 (queue "
                                "full)", registry=r)
        self.stage_requests = Counter("omnistage_stage_requests", "Requests finished per stage",
                                      ["stage", "finish_reason"], registry=r)
        self.stage_tokens = Counter("omnistage_stage_generated_tokens", "Tokens generated per "
                                    "stage (codec codes for the talker)", ["stage"], registry=r)
        self.audio_seconds = Counter("omnistage_audio_seconds", "Seconds of audio generated",
                                     registry=r)
        self.ttft = Histogram("omnistage_time_to_first_token_seconds", "Time to the first text "
                              "token", buckets=LATENCY_BUCKETS, registry=r)
        self.ttfa = Histogram("omnistage_time_to_first_audio_seconds", "Time to the first audio "
                              "sample", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("omnistage_e2e_request_latency_seconds", "Request latency, arrival "
                             "to the last output", buckets=LATENCY_BUCKETS, registry=r)
        self.tps = Histogram("omnistage_request_tokens_per_second", "Per request: a stage's "
                             "tokens over the request's e2e time", ["stage"],
                             buckets=TPS_BUCKETS, registry=r)
        # the server path (RequestTimeline): where a request's time goes before the runtime
        # and between the runtime and the client
        self.prepare = Histogram("omnistage_server_prepare_seconds", "HTTP request received to "
                                 "prepared (parsing, waiting for and running the preparation "
                                 "pool: template, tokens, media)", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.admission = Histogram("omnistage_server_admission_seconds", "Prepared to taken in "
                                   "by the runtime loop", buckets=LATENCY_BUCKETS, registry=r)
        self.http_ttft = Histogram("omnistage_server_time_to_first_text_seconds", "HTTP request "
                                   "received to its first text event written (chat streams)",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.http_ttfa = Histogram("omnistage_server_time_to_first_audio_seconds", "HTTP "
                                   "request received to its first audio event written (chat "
                                   "streams)", buckets=LATENCY_BUCKETS, registry=r)
        startup = Gauge("omnistage_startup_seconds", "Seconds the engine took to build, by "
                        "phase: 'total', each stage, its 'weights', 'engine' (KV cache, compiled "
                        "layers) and 'graphs' (CUDA graph capture), and 'runtime'", ["phase"],
                        registry=r)
        for name, seconds in getattr(llm, "startup_seconds", {}).items():
            startup.labels(name).set(round(seconds, 3))
        r.register(_RuntimeCollector(llm, in_flight))

    def observe_finished(self, endpoint: str, out: OmniRequestOutput) -> None:
        """Record one finished request (its last output); RequestCounter counts the HTTP
        request itself."""
        m = out.metrics
        for stage, so in out.stages.items():
            self.stage_requests.labels(stage, so.finish_reason or "none").inc()
            if so.audio is not None and out.sample_rate:
                self.audio_seconds.inc(len(so.audio) / out.sample_rate)
        for stage, n in m.tokens_per_stage.items():
            if n:
                self.stage_tokens.labels(stage).inc(n)
                if m.e2e:
                    self.tps.labels(stage).observe(n / m.e2e)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.ttfa is not None:
            self.ttfa.observe(m.ttfa)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)

    def observe_timeline(self, timeline: Any) -> None:
        """Record a request's server path (serving.RequestTimeline), once it ends."""
        if timeline is None or timeline.prepared is None:
            return
        self.prepare.observe(timeline.prepared - timeline.received)
        if timeline.admitted is not None:
            self.admission.observe(max(0.0, timeline.admitted - timeline.prepared))
        if timeline.first_text is not None:
            self.http_ttft.observe(timeline.first_text - timeline.received)
        if timeline.first_audio is not None:
            self.http_ttfa.observe(timeline.first_audio - timeline.received)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ------------------------------------------------------------------ per HTTP request
# where a handler records how a response with a 200 status line ended, when not in full:
# "error" (an error event in the stream) or "499" (the client went away)
OUTCOME_KEY = "omnistage.outcome"
RECEIVED_KEY = "omnistage.received"  # when RequestCounter saw the request (time.monotonic())
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
              "/v1/audio/speech": "speech", "/v1/audio/transcriptions": "transcriptions",
              "/v1/images/generations": "images"}
_UNCOUNTED = {"/health", "/metrics"}  # probes and scrapes


def mark_outcome(scope: dict[str, Any] | None, outcome: str) -> None:
    """Record in a request's ASGI scope how its 200 response ended (see OUTCOME_KEY)."""
    if scope is not None:
        scope[OUTCOME_KEY] = outcome


def _endpoint(path: str) -> str:
    if path in _ENDPOINTS:
        return _ENDPOINTS[path]
    return "models" if path.startswith("/v1/models") else "other"


def _status(code: int | None, outcome: str | None) -> str:
    if code == 200:
        return outcome or "ok"
    if code is None:  # no response started: the client left, or the app failed
        return outcome or "500"
    return str(code)


class RequestCounter:
    """Pure ASGI middleware, outermost: counts every HTTP request once, with its status, in
    `omnistage_http_requests_total`, including those refused before any route runs (401, 413)
    or by an exception handler (400, 404, 429). Counted as the last body message goes out (a
    client that reads the response and then scrapes sees it), or when the app returns."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNCOUNTED:
            return await self.app(scope, receive, send)
        scope[RECEIVED_KEY] = time.monotonic()
        endpoint = _endpoint(scope["path"])
        code: int | None = None
        counted = False

        def count() -> None:
            nonlocal counted
            if not counted:
                counted = True
                self.metrics.requests.labels(endpoint, _status(code, scope.get(OUTCOME_KEY))
                                             ).inc()

        async def counting_send(message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                count()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            count()
