"""A replay of requests through the prefix cache, by the engine's own admission code.

Requests run one after another, as a sequential replay of a log sends them, through
the engine's Scheduler and KVCacheManager (with a host tier, KVTiers) of the size
given: a step admits a request (its longest cached run of leading full blocks in the
pool, capped so its last prompt token is computed, then the host tier's blocks that
follow; blocks for its prompt, least recently released first), a second step computes
its output tokens (which a replay knows already), and it finishes, releasing its blocks
last first; blocks evicted on the way go to the host tier. Nothing here decides what
is cached: the engine does. The requests carry the hashes of their blocks (a log's are
keyed); tokens beyond those hashes are stand-ins no real prompt has, so such blocks
take room but never hit. A request whose KV cannot fit the pool at all is refused, as
the engine refuses it. With no device size the cache is unbounded (nothing is ever
evicted: the hits are the longest runs of blocks seen before, within the same cap). A
disk tier is not modelled: with one, the prediction is a lower bound.

A window model's grouped pool (CacheSize.windows: core/kv_groups.py) is replayed as
the engine runs it: the same KVCacheManager with the same groups and retention interval,
the prompt in one step, then its output a token a step (each step releases the window
blocks its sequence has left behind, as the engine's steps do; a one-group pool only
grows, so its output is one step). The server's chunked prefill of a prompt longer than
its token budget releases window blocks between chunks, which the replay does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hotprefix.cachecurve.request import SimRequest
from hotprefix.config import SchedulerConfig
from hotprefix.core.block_pool import IntegrityError
from hotprefix.core.kv_cache_manager import KVCacheManager
from hotprefix.core.kv_tiers import KVTiers
from hotprefix.core.outputs import ModelRunnerOutput
from hotprefix.core.request import Request
from hotprefix.core.scheduler import Scheduler
from hotprefix.sampling_params import SamplingParams
from hotprefix.sizing import blocks_for_tokens, max_cached_blocks, window_blocks

MAX_STEP_TOKENS = 1 << 30  # a step's token budget: a prompt, or a request's output, in one step


@dataclass(frozen=True)
class CacheSize:
    """The cache a prediction assumes: device blocks (None: unbounded) and host-tier blocks,
    and the pool's KV-cache groups (KVCacheManager's group_windows and retain_every: a
    window model's grouped pool, whose blocks are pages of one group)."""

    device_blocks: int | None = None
    host_blocks: int = 0
    source: str = "default"  # where the size came from (flags, the log)
    windows: tuple[int | None, ...] = (None,)
    retain_every: int = 0

    def __post_init__(self) -> None:
        if self.device_blocks is not None and self.device_blocks < 1:
            raise ValueError(f"the cache needs at least one block, got {self.device_blocks}")
        if self.host_blocks < 0:
            raise ValueError(f"host tier blocks must be >= 0, got {self.host_blocks}")

    @property
    def grouped(self) -> bool:
        return len(self.windows) > 1

    def describe(self, block_size: int) -> str:
        if self.device_blocks is None:
            return "an unbounded cache (no eviction)"
        host = f" + host tier {self.host_blocks} blocks" if self.host_blocks else ""
        kinds = ", ".join(sorted({f"window {w}" for w in self.windows if w is not None}))
        groups = (f"; {len(self.windows)} KV groups (full, {kinds}), a block a page of one group's layers"
                  if self.grouped else "")
        what = f"blocks of {block_size} tokens ({self.device_blocks * block_size} tokens)" if not self.grouped \
            else f"blocks of {block_size} tokens"
        return f"{self.device_blocks} {what}{host}{groups}, LRU eviction as the server's pool ({self.source})"


@dataclass
class Replay:
    """Per request: cached prompt tokens, and blocks shared with some earlier request
    (what an unbounded cache could give, before the cap)."""

    hits: list[int] = field(default_factory=list)
    shared_blocks: list[int] = field(default_factory=list)
    too_big: int = 0  # requests that did not fit the pool at all (the server would refuse them)

    @property
    def total_hits(self) -> int:
        return sum(self.hits)


def replay(reqs: Sequence[SimRequest], block_size: int, size: CacheSize = CacheSize(),
           pinned: Sequence[SimRequest] = ()) -> Replay:
    """Run reqs in order through a cache of the given size (see the module doc), after
    computing and pinning the full blocks of the `pinned` prompts (as POST /pin does; any
    share of the pool). Raises PinError when a pin does not fit."""
    if size.device_blocks is None:
        return _unbounded(reqs, block_size, {h for r in pinned for h in r.hashes[:r.prompt_tokens // block_size]})
    engine = _Engine(size, block_size)
    for i, r in enumerate(pinned, len(reqs)):
        engine.run(i, r)
        engine.kv.pin(list(r.hashes[:r.prompt_tokens // block_size]))
    out = Replay()
    seen: set[bytes] = set()
    for i, r in enumerate(reqs):
        out.shared_blocks.append(_leading(r.hashes, seen))
        hit = engine.run(i, r)
        out.too_big += hit is None
        out.hits.append(hit or 0)
        seen.update(r.hashes[:r.computed_tokens // block_size])
    return out


def _leading(hashes: Sequence[bytes], seen: set[bytes]) -> int:
    """How many leading hashes are in `seen`."""
    n = 0
    while n < len(hashes) and hashes[n] in seen:
        n += 1
    return n


def _unbounded(reqs: Sequence[SimRequest], block_size: int, seen: set[bytes]) -> Replay:
    out = Replay()
    for r in reqs:
        cap = min(max_cached_blocks(r.prompt_tokens, block_size), len(r.hashes))
        n = _leading(r.hashes, seen)
        out.shared_blocks.append(n)
        out.hits.append(min(n, cap) * block_size)
        seen.update(r.hashes[:r.computed_tokens // block_size])
    return out


class _Engine:
    """The engine's scheduler and KV cache manager (with a host tier; a grouped pool's
    groups), without a model: the replay samples nothing, the tokens are known."""

    def __init__(self, size: CacheSize, block_size: int) -> None:
        if size.device_blocks is None:
            raise ValueError("an unbounded cache is replayed without an engine")
        self.size = size
        self.kv = KVCacheManager(size.device_blocks, block_size, max_pinned_fraction=1.0,
                                 tiers=KVTiers(size.host_blocks) if size.host_blocks else None,
                                 group_windows=size.windows, retain_every=size.retain_every)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=MAX_STEP_TOKENS), self.kv)

    def run(self, index: int, r: SimRequest) -> int | None:
        """Serve one request (whose blocks have `r.hashes`) to its end; the prompt tokens
        it found cached, or None when the engine would refuse it (its KV cannot fit the
        pool: LLMEngine's check)."""
        if self._blocks(r) > self.kv.num_blocks:
            return None
        stand_in = -1 - index  # no real token: blocks past the known hashes never match another request's
        params = SamplingParams(max_tokens=max(r.output_tokens, 1))
        req = Request(f"replay-{index}", [stand_in] * r.prompt_tokens, params, block_hashes=list(r.hashes))
        self.scheduler.add_request(req)
        self._step(req, stand_in)  # admitted: the prompt
        if not req.status.finished and not self.size.grouped:  # the output, at once: the replay knows its tokens
            req.output_token_ids.extend([stand_in] * (r.output_tokens - 2))
            self._step(req, stand_in)
        for _ in range(r.output_tokens):  # a grouped pool: a token a step, releasing window blocks as the engine
            if req.status.finished:
                break
            self._step(req, stand_in)
        if not req.status.finished or req.num_cached_tokens is None:
            raise IntegrityError(f"replay request {index} did not run to its end")
        return req.num_cached_tokens

    def _blocks(self, r: SimRequest) -> int:
        """The most blocks the request holds at once (LLMEngine's check: a grouped pool's window
        groups hold their window's, and the prompt's chunk, beside the full group's)."""
        n, bs = r.computed_tokens, self.kv.block_size
        return blocks_for_tokens(n, bs) + window_blocks(self.size.windows, n, bs, r.prompt_tokens)

    def _step(self, req: Request, token: int) -> None:
        sched = self.scheduler.schedule()
        self.scheduler.update(sched, ModelRunnerOutput(sampled_token_ids={req.request_id: token}))
