"""Prometheus metrics under `hotprefix:` (or `vllm:` with --metrics-prefix vllm), with
vLLM V1's names and meanings.

Engine-side numbers (running/waiting, KV usage, prefix-cache queries and hits
in tokens, preemptions) are read from the async engine's counters at scrape
time; per-request numbers (tokens, latencies, finish reasons) are observed by
the handlers when a request ends. Every metric carries `model_name`. One
registry per app: no module-level state.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from hotprefix import metric_names as N
from hotprefix.engine.async_engine import AsyncEngine
from hotprefix.engine.counters import ITERATION_BUCKETS, EngineCounters, TierGauges
from hotprefix.engine.llm_engine import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str, cache_info: dict[str, str], prefix: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.cache_info = cache_info
        self.p = prefix

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(self.p + name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(self.p + name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def collect(self) -> Iterator[Metric]:
        c = self.engine.counters
        live = self.engine.live  # published by the engine thread after each step and each batch of commands
        yield self._gauge(N.RUNNING, "Requests in the running batch.", live.running)
        yield self._gauge(N.WAITING, "Requests waiting to be scheduled.", live.waiting)
        yield self._gauge(N.SWAPPED, "Requests swapped out to host memory.", live.swapped)
        yield self._gauge(N.KV_USAGE, "KV-cache usage: 1 means 100 percent.", live.kv_usage)
        yield self._gauge(N.KV_USAGE_LEGACY, "KV-cache usage (vLLM's older name).", live.kv_usage)
        yield self._gauge(N.PREFIX_HIT_RATE_LEGACY, "Prefix-cache hit rate since start, in tokens (vLLM's older "
                          "gauge).", c.prefix_cache_hits / c.prefix_cache_queries if c.prefix_cache_queries else 0.0)
        yield self._iterations(c)
        yield self._counter(N.PREEMPTIONS, "Cumulative preemptions.", live.preemptions)
        yield self._counter(N.PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache.",
                            c.prefix_cache_queries)
        yield self._counter(N.PREFIX_HITS, "Prompt tokens served from the prefix cache.", c.prefix_cache_hits)
        yield self._counter(N.PREFIX_EVICTED, "Cached blocks whose slot was reused.", c.evicted_blocks)
        yield from self._tiers(c, live.tiers)
        yield from self._speculation(c)
        info = GaugeMetricFamily(self.p + N.CACHE_CONFIG_INFO, "Information of the KV cache configuration.",
                                 labels=["model_name", *self.cache_info])
        info.add_metric([self.model_name, *self.cache_info.values()], 1.0)
        yield info


    def _iterations(self, c: EngineCounters) -> Metric:
        h = HistogramMetricFamily(self.p + N.ITERATION_TOKENS, "Tokens run through the model per engine step.",
                                  labels=["model_name"])
        counts = list(c.iteration_counts)  # (a copy: the engine thread adds to it)
        bounds = [str(float(b)) for b in ITERATION_BUCKETS] + ["+Inf"]
        h.add_metric([self.model_name], list(zip(bounds, accumulate(counts))), c.iteration_tokens)
        return h

    def _labelled(self, family: type, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
        m = family(self.p + name, doc, labels=["model_name", label])
        for k, v in values.items():
            m.add_metric([self.model_name, k], v)
        return m

    def _speculation(self, c: EngineCounters) -> Iterator[Metric]:
        """vLLM's speculative decoding counters, with --speculative-config."""
        if c.spec_accepted_per_pos is None:
            return
        yield self._counter(N.SPEC_DRAFTS, "Drafts verified (speculative decoding).", c.spec_drafts)
        yield self._counter(N.SPEC_DRAFT_TOKENS, "Draft tokens verified.", c.spec_draft_tokens)
        yield self._counter(N.SPEC_ACCEPTED_TOKENS, "Draft tokens accepted.", c.spec_accepted_tokens)
        yield self._labelled(CounterMetricFamily, N.SPEC_ACCEPTED_PER_POS, "Draft tokens accepted, by their "
                             "position in the draft (0..2k-1: positions k and on only in constrained requests' "
                             "drafts, their grammar's forced tokens before the n-gram's).", "position",
                             {str(i): n for i, n in enumerate(list(c.spec_accepted_per_pos))})

    def _tiers(self, c: EngineCounters, t: TierGauges | None) -> Iterator[Metric]:
        """The cached tokens by source, and (with tiers) what each tier holds and moved."""
        yield self._labelled(CounterMetricFamily, N.CACHED_BY_SOURCE, "Prompt tokens served from the cache, by the "
                             "tier they were found in.", "source", c.cached_tokens_by_source)
        if t is None:
            return
        yield self._labelled(GaugeMetricFamily, N.KV_TIER_BLOCKS, "KV blocks a tier below the pool holds.", "tier",
                             {"host": t.host_blocks, "disk": t.disk_blocks})
        yield self._labelled(GaugeMetricFamily, N.KV_TIER_CAPACITY, "KV blocks a tier below the pool can hold.",
                             "tier", {"host": t.host_capacity, "disk": t.disk_capacity})
        moved = {"pool_to_host": c.offloaded_blocks, "host_to_pool": c.loaded_blocks,
                 "to_disk": t.disk_written_blocks, "from_disk": t.disk_read_blocks}
        size = {"pool_to_host": t.host_block_bytes, "host_to_pool": t.host_block_bytes,
                "to_disk": t.disk_file_bytes, "from_disk": t.disk_file_bytes}
        yield self._labelled(CounterMetricFamily, N.KV_TIER_MOVED_BLOCKS, "KV blocks copied between tiers.",
                             "direction", moved)
        yield self._labelled(CounterMetricFamily, N.KV_TIER_MOVED_BYTES, "Bytes of KV copied between tiers.",
                             "direction", {k: v * size[k] for k, v in moved.items()})
        yield self._counter(N.KV_TIER_BAD_FILES, "Disk-tier files refused (corrupt, truncated, another model's).",
                            t.disk_bad_files)


class Recent:
    """The latest observations (monotonic time, value), at most `size`: exact percentiles
    over a recent window (the histograms only know their buckets)."""

    def __init__(self, size: int = 20_000) -> None:
        self.items: deque[tuple[float, float]] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self.items.append((time.monotonic(), value))

    def percentiles(self, since: float, ps: tuple[float, ...] = (0.5, 0.95)) -> tuple[list[float | None], int]:
        """The ps-quantiles (nearest rank) of the values observed since `since`, and how many there were."""
        vals = sorted(v for t, v in self.items if t >= since)
        if not vals:
            return [None for _ in ps], 0
        return [vals[min(len(vals) - 1, max(0, math.ceil(p * len(vals)) - 1))] for p in ps], len(vals)


class ServerMetrics:
    """The app's registry and its per-request metrics; names start with `prefix:`."""

    def __init__(self, engine: AsyncEngine, model_name: str, cache_info: dict[str, str],
                 prefix: str = "hotprefix") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        P = prefix + ":"  # noqa: N806 - reads like the names it builds
        self.registry.register(_EngineCollector(engine, model_name, cache_info, P))
        r, lbl = self.registry, ["model_name"]
        self.recent_ttft, self.recent_itl = Recent(), Recent()  # raw, for the dashboard's percentiles
        self.prompt_tokens = Counter(P + N.PROMPT_TOKENS, "Prompt tokens processed.", lbl, registry=r)
        self.generation_tokens = Counter(P + N.GENERATION_TOKENS, "Generated tokens.", lbl, registry=r)
        self.cached_tokens = Counter(P + N.CACHED_PROMPT_TOKENS, "Prompt tokens served from the prefix cache.",
                                     lbl, registry=r)
        self.request_success = Counter(P + N.REQUEST_SUCCESS, "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram(P + N.TTFT, "Time to first token.", lbl,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + N.ITL, "Time between output tokens.", lbl,
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram(P + N.TPOT_LEGACY, "Time between output tokens (vLLM's older name).", lbl,
                              buckets=ITL_BUCKETS, registry=r)
        self.phases = {name: Histogram(P + name, doc, lbl, buckets=LATENCY_BUCKETS, registry=r) for name, doc in (
            (N.PREFILL_TIME, "Time from first scheduled to first token."),
            (N.DECODE_TIME, "Time from first token to finished."),
            (N.INFERENCE_TIME, "Time from first scheduled to finished."))}
        self.params_n = Histogram(P + N.PARAMS_N, "The n of each request.", lbl, buckets=(1, 2, 5, 10, 20),
                                  registry=r)
        self.params_max_tokens = Histogram(P + N.PARAMS_MAX_TOKENS, "The max_tokens of each request.", lbl,
                                           buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(P + N.E2E, "End-to-end request latency.", lbl,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(P + N.QUEUE_TIME, "Time spent waiting before first scheduled.",
                                    lbl, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram(P + N.REQUEST_PROMPT_TOKENS, "Prompt tokens per request.", lbl,
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.gen_len = Histogram(P + N.REQUEST_GENERATION_TOKENS, "Generated tokens per request.", lbl,
                                 buckets=TOKEN_BUCKETS, registry=r)
        self.rejections = Counter(P + N.REQUEST_REJECTIONS, "Requests refused before reaching the engine, by "
                                  "reason: invalid, body_too_large, unauthorized, queue_full, engine_not_running.",
                                  ["model_name", "reason"], registry=r)

    def total(self, counter: Counter) -> int:
        """One of this object's counters, as /metrics exports it (read from the counter itself)."""
        (family,) = counter.collect()
        return int(next((s.value for s in family.samples if s.name.endswith("_total")
                         and s.labels.get("model_name") == self.model_name), 0))

    def rejected(self, reason: str) -> None:
        """Count one refused request (see REJECTION_REASONS)."""
        self.rejections.labels(self.model_name, reason).inc()

    def observe_token_gap(self, seconds: float) -> None:
        self.recent_itl.add(seconds)
        self.itl.labels(self.model_name).observe(seconds)
        self.tpot.labels(self.model_name).observe(seconds)

    def observe_params(self, n: int, max_tokens: int) -> None:
        """A request's n and (effective) max_tokens, when it is submitted."""
        self.params_n.labels(self.model_name).observe(n)
        self.params_max_tokens.labels(self.model_name).observe(max_tokens)

    def observe_finished(self, out: RequestOutput) -> None:
        """Record a finished (or aborted, with finish_reason 'abort') request."""
        m = self.model_name
        completion = sum(len(o.token_ids) for o in out.outputs)
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(completion)
        self.cached_tokens.labels(m).inc(out.num_cached_tokens)
        for o in out.outputs:
            self.request_success.labels(m, o.finish_reason or "abort").inc()
        self.prompt_len.labels(m).observe(len(out.prompt_token_ids))
        self.gen_len.labels(m).observe(completion)
        if out.first_token_time is not None:
            self.recent_ttft.add(out.first_token_time - out.arrival_time)
            self.ttft.labels(m).observe(out.first_token_time - out.arrival_time)
        if out.first_scheduled_time is not None:
            self.queue_time.labels(m).observe(out.first_scheduled_time - out.arrival_time)
        if out.finished_time is not None:
            self.e2e.labels(m).observe(out.finished_time - out.arrival_time)
        self._observe_phases(out)

    def _observe_phases(self, out: RequestOutput) -> None:
        """Prefill, decode and inference time of a finished request (those it reached)."""
        sched, first, end = out.first_scheduled_time, out.first_token_time, out.finished_time
        for name, a, b in ((N.PREFILL_TIME, sched, first), (N.DECODE_TIME, first, end), (N.INFERENCE_TIME, sched, end)):
            if a is not None and b is not None:
                self.phases[name].labels(self.model_name).observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)
