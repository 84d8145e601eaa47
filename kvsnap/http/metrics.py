"""``GET /metrics``: the server in Prometheus's text format (prometheus_client), admin-only
when keys are set.

One ``Metrics`` per app, with its own ``CollectorRegistry`` (never the process-wide default
one): two apps in one process share no counter. What the app sees itself is counted here: the
requests by route and status (``RequestCounter``, outside the key guard, so refusals count
too) and each generation's time to first token and per output token, observed when the engine
ends it. Everything else is read from the engine at scrape time (``EngineCollector``): the
same numbers ``/v1/status`` shows, so the two never disagree.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest as _render
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool
from starlette.routing import BaseRoute, Match

from kvsnap.runtime.engine.types import RequestState

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Label values a client cannot multiply: any other method, and a path no route has, count
# as "other" (a series per invented path would grow the registry without bound).
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
OTHER = "other"


class Metrics:
    """One app's metrics: its registry, the request counter and the two latency histograms."""

    def __init__(self, engine: Any, inflight: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvsnap_http_requests",
            "HTTP requests answered, by route template, method and status code",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvsnap_time_to_first_token_seconds",
            "seconds from a generation's submission to the engine to its first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "kvsnap_time_per_output_token_seconds",
            "a generation's mean seconds per output token after the first (two tokens or more)",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(engine, inflight))

    def request(self, route: str, method: str, status: int) -> None:
        self.requests.labels(route, method, str(status)).inc()

    def finished(self, state: RequestState) -> None:
        """The engine ended a generation (however it ended): its latencies, once known."""
        first, done = state.t_first_token, state.t_done
        if first is None:
            return
        self.ttft.observe(first - state.t_submit)
        if done is not None and state.completion_tokens >= 2:
            self.tpot.observe((done - first) / (state.completion_tokens - 1))

    def render(self) -> bytes:
        return _render(self.registry)


class EngineCollector(Collector):
    """The engine's state as metrics, read at each scrape from ``Engine.status()`` (what
    ``/v1/status`` shows) and the prefix cache's entries."""

    def __init__(self, engine: Any, inflight: Callable[[], int]):
        self.engine = engine
        self.inflight = inflight

    def collect(self) -> Iterator[Metric]:
        status = self.engine.status()
        tokens, cache = status["tokens"], status["cache"]
        yield _counter(
            "kvsnap_prompt_tokens", "prompt tokens of the requests started", tokens["prompt"]
        )
        yield _counter(
            "kvsnap_cached_tokens",
            "of those, served from the prefix cache (the exact count, before any rounding "
            "for clients)",
            tokens["cached"],
        )
        yield _counter(
            "kvsnap_computed_tokens", "prompt tokens the model really ran", tokens["computed"]
        )
        yield _gauge("kvsnap_requests_inflight", "requests admitted and not ended", self.inflight())
        yield _gauge("kvsnap_requests_running", "requests in the batch", status["batch_size"])
        yield _gauge("kvsnap_requests_waiting", "requests queued for the batch", status["waiting"])
        yield from self._entries()
        yield _counter("kvsnap_cache_hits", "prefix-cache lookups that matched", cache["hits"])
        yield _counter("kvsnap_cache_misses", "prefix-cache lookups with no match", cache["misses"])
        yield _counter(
            "kvsnap_cache_evictions",
            "request prefixes dropped from memory for the cache budget",
            cache["evictions"],
        )
        yield from self._restore(status)
        yield from self._persist(status["persist"])

    def _entries(self) -> Iterator[Metric]:
        entries = GaugeMetricFamily(
            "kvsnap_cache_entries",
            "prefix-cache entries: warm (the warm prompts', shared) and request (kept prefixes)",
            labels=["kind"],
        )
        held = GaugeMetricFamily(
            "kvsnap_cache_bytes",
            "bytes of the prefix-cache entries loaded in memory",
            labels=["kind"],
            unit="bytes",
        )
        count = {"warm": 0, "request": 0}
        nbytes = {"warm": 0, "request": 0}
        loaded = self.engine.loaded.is_set() and self.engine.failed is None
        for entry in self.engine.prefix.entries if loaded else ():
            kind = "warm" if entry.namespace is None else "request"
            count[kind] += 1
            nbytes[kind] += entry.nbytes if entry.loaded else 0
        for kind in count:
            entries.add_metric([kind], count[kind])
            held.add_metric([kind], nbytes[kind])
        yield entries
        yield held

    @staticmethod
    def _restore(status: dict) -> Iterator[Metric]:
        warmup = status["warmup"] or {}
        snapshots = status["snapshots"]
        yield _gauge(
            "kvsnap_restore_seconds",
            "seconds the latest warm-up took: snapshots restored, the rest prefilled",
            warmup.get("seconds", 0.0),
        )
        yield _gauge(
            "kvsnap_restore_prefetch_seconds",
            "seconds reading the pinned snapshots, overlapped with the model load",
            warmup.get("prefetch_seconds", 0.0),
        )
        yield _counter(
            "kvsnap_snapshots_loaded",
            "snapshots restored into the cache (at start, on first hit, on re-warms)",
            snapshots.get("loaded", 0),
        )
        yield _counter(
            "kvsnap_snapshots_prefilled",
            "warm prompts prefilled for want of a usable snapshot",
            snapshots.get("prefilled", 0),
        )

    @staticmethod
    def _persist(persist: dict) -> Iterator[Metric]:
        yield _gauge(
            "kvsnap_persist_enabled",
            "1 while request prefixes are persisted (--persist-requests)",
            int(bool(persist.get("enabled")) and not persist.get("disabled")),
        )
        yield _gauge(
            "kvsnap_persist_queue_depth",
            "conversation writes queued for the disk",
            persist.get("queued", 0),
        )
        for name, key, text in (
            ("kvsnap_persist_writes", "written", "conversations written to the store"),
            ("kvsnap_persist_drops", "dropped", "queued writes dropped for a full queue"),
            ("kvsnap_persist_evictions", "evicted", "conversations removed for the disk budget"),
            ("kvsnap_persist_failures", "failed", "conversation writes that failed"),
        ):
            yield _counter(name, text, persist.get(key, 0))
        tier = persist.get("shared_tier") or {}
        if tier.get("enabled"):
            yield from _shared_tier(tier)


BREAKER_STATES = ("closed", "open", "half-open")
TIER_COUNTERS = (
    ("kvsnap_tier_hits", "hits", "conversations fetched from the shared tier"),
    ("kvsnap_tier_kept", "kept", "fetched conversations then written to the local store"),
    ("kvsnap_tier_misses", "misses", "lookups the shared tier held nothing for (or evicted)"),
    ("kvsnap_tier_fetched_tokens", "fetched_tokens", "prompt tokens fetched instead of prefilled"),
    ("kvsnap_tier_bytes_in", "bytes_in", "bytes fetched from the shared tier"),
    ("kvsnap_tier_bytes_out", "bytes_out", "bytes written behind to the shared tier"),
    ("kvsnap_tier_fetch_seconds", "fetch_seconds", "seconds spent fetching from the tier"),
    (
        "kvsnap_tier_skipped_slower",
        "skipped_slower",
        "fetches skipped as slower than prefilling (or past the budget)",
    ),
    ("kvsnap_tier_skipped_open", "skipped_open", "lookups not made: the breaker was open"),
    ("kvsnap_tier_timeouts", "timeouts", "fetches abandoned at the budget"),
    ("kvsnap_tier_bad_values", "bad_values", "values that failed their checks (never loaded)"),
    ("kvsnap_tier_errors", "errors", "tier calls that failed or were refused"),
    ("kvsnap_tier_writes", "writes", "conversations written behind to the tier"),
    ("kvsnap_tier_drops", "drops", "write-behinds dropped (full queue, or breaker open)"),
    ("kvsnap_tier_superseded", "superseded", "write-behinds whose record the next turn replaced"),
    ("kvsnap_tier_breaker_opens", "breaker_opens", "times the breaker opened"),
)


def _shared_tier(tier: dict) -> Iterator[Metric]:
    """--shared-tier: what the fleet's tier gave and took, and whether it is asked."""
    family = GaugeMetricFamily(
        "kvsnap_tier_breaker_state",
        "1 for the breaker's state (closed: asked; open: not asked; half-open: probing)",
        labels=["state"],
    )
    for state in BREAKER_STATES:
        family.add_metric([state], int(tier.get("breaker") == state))
    yield family
    yield _gauge(
        "kvsnap_tier_queue_depth",
        "conversations waiting to be written behind",
        tier["queue_depth"],
    )
    yield _gauge(
        "kvsnap_tier_queue_bytes", "bytes waiting to be written behind", tier["queue_bytes"]
    )
    for name, key, text in TIER_COUNTERS:
        yield _counter(name, text, tier.get(key, 0))


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, value=value)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


class RequestCounter:
    """Counts every HTTP answer by route template, method and status: pure ASGI, outermost,
    so the key guard's 401 and 413 count too and streaming passes through untouched."""

    def __init__(self, app, metrics: Metrics, routes: Sequence[BaseRoute]):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # unless a response starts: an exception the server answers with 500

        async def seen_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, seen_send)
        finally:
            method = scope.get("method", "")
            route = route_of(self.routes, scope)
            self.metrics.request(route, method if method in METHODS else OTHER, status)


def route_of(routes: Sequence[BaseRoute], scope: dict) -> str:
    """The path template of the route the request's path belongs to (whatever its method),
    or "other"; matched here, since a request the guard refuses never reaches the router."""
    for route in routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            return getattr(route, "path", OTHER)
    return OTHER


def metrics_router(metrics: Metrics, require_admin: Callable[[Request], None]) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def scrape(request: Request):
        require_admin(request)
        # A thread, not the event loop, as /v1/status: reading the engine takes its locks.
        body = await run_in_threadpool(metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router
