"""The scheduler: which requests run each step and how many tokens each computes.

One rule: every step, each chosen request's `num_computed_tokens` catches up
towards `num_tokens` within the step's token budget (chunked prefill). A prefill
chunk and a decode token are the same thing here.

Order within a step: running requests first (in admission order), then swapped
ones coming back, then waiting ones (fcfs: arrival order; priority: lowest
`priority` value first, ties by arrival). A waiting request starts from its
longest cached prefix (see kv_cache_manager): only the uncached tokens run; a
sample of n > 1 waits until the first sample has computed their prompt, then
starts from its blocks.

Between tenants (Request.tenant), each step's token budget and seats are shared
fairly by weight (core/fairness.py): a request takes tokens only within its
tenant's allowance for the step, and a tenant holding its share of seats is not
admitted more; its queued requests are passed over, not waited for.

Out of blocks while serving a running request: a victim is preempted among the
running requests not yet scheduled in this step (fcfs: the last admitted;
priority: the lowest priority, latest arrival). In recompute
mode its blocks are freed and it is recomputed later (looking the cache up
again); in swap mode its blocks are copied to host memory and back.

A step either succeeds (`update()` commits the cache entries it made) or fails
(`fail_step()` rolls them back and fails only the requests it scheduled, which
may have half-written KV); requests outside the step go on untouched.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import Counter
from collections.abc import Iterable

from hotprefix.config import PreemptionMode, SchedulerConfig, SchedulingPolicy
from hotprefix.core.block_pool import IntegrityError
from hotprefix.core.fairness import FairShares, Tenant
from hotprefix.core.kv_cache_manager import KVCacheManager, PinError
from hotprefix.core.kv_tiers import Source, TierStats
from hotprefix.core.outputs import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from hotprefix.core.request import Request, RequestStatus
from hotprefix.core.speculation import GrammarDrafts, Speculator
from hotprefix.core.stats import SchedulerStats
from hotprefix.core.swap import SwapSpace
from hotprefix.sizing import blocks_for_tokens

log = logging.getLogger(__name__)


class WaitingQueue:
    """Requests not yet admitted, in the policy's order."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._items: list[tuple[tuple, Request]] = []
        self._seq = itertools.count()

    def _key(self, req: Request, front: bool) -> tuple:
        if self.policy is SchedulingPolicy.PRIORITY:
            return (req.priority, req.arrival_time, next(self._seq))
        return (-next(self._seq),) if front else (0, next(self._seq))

    def push(self, req: Request, front: bool = False) -> None:
        """Queue a request; front=True (fcfs) puts a preempted one before everyone."""
        item = (self._key(req, front), req)
        bisect.insort(self._items, item, key=lambda it: it[0])

    def peek(self) -> Request:
        return self._items[0][1]

    def pop(self) -> Request:
        return self._items.pop(0)[1]

    def remove(self, req: Request) -> None:
        self._items = [it for it in self._items if it[1] is not req]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return (r for _, r in self._items)


class Scheduler:
    """Owns the waiting, running and swapped queues, the KV cache manager and
    the swap space.

    `schedule()` mutates requests' progress and status, takes blocks and may
    preempt; `update()` appends sampled tokens and finishes requests;
    `finish_requests()` ends requests in any state and returns every block.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, num_host_blocks: int = 0,
                 grammar: GrammarDrafts | None = None) -> None:
        """grammar: what a constrained request's grammar forces next and how much of a draft
        it accepts (the runner's matchers; None: constrained requests do not draft)."""
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.swap = SwapSpace(num_host_blocks)
        self._finished_ids: set[str] = set()
        self._host_to_free: list[int] = []
        self.num_preemptions = 0
        self._step_preemptions = 0
        self._last_tokens = (0, 0)
        self._device_hit_blocks = 0  # since the last make_stats
        self.shares = FairShares(dict(config.tenant_weights))
        spec = config.speculative_config
        self.spec = Speculator(spec, grammar) if spec is not None else None  # core/speculation.py; None: off
        self._drafts: dict[str, list[int]] = {}  # this step's, by request id

    # -- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises IntegrityError for an id already queued (a bug:
        LLMEngine.enqueue is the one check callers see). How many may wait is
        decided before a request gets here (AsyncEngine's admission)."""
        if request.request_id in self.requests:
            raise IntegrityError(f"request id {request.request_id!r} is already in the scheduler")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (or abort) requests in any state, returning all their blocks,
        host blocks included. Unknown or already finished ids are ignored."""
        if not status.finished:
            raise IntegrityError(f"finish_requests with the unfinished status {status}")
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
                self._host_to_free.extend(req.host_block_ids)
                req.host_block_ids = []
            else:
                self.waiting.remove(req)
            req.status = status
            self.kv.free(req)
            if self.spec is not None:
                self.spec.finished(req)
            self._finished_ids.add(rid)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        t = self.config.long_prefill_token_threshold
        if 0 < t < n:
            n = t
        return min(n, budget)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work. Mutates queues, requests and the pools. If it
        raises (a bug), the cache entries it made are rolled back first; the
        caller then fails every request (`fail_all`)."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()
        self._step_preemptions = 0
        if self.kv.tiers is not None:
            self.kv.tiers.end_step()  # the runner made the last step's tier copies
        try:
            self._drafts = self._propose()
            self.shares.plan(self.config.token_budget, self.config.max_num_seqs, *self._demands())
            budget = self._schedule_running(out, self.config.token_budget)
            budget = self._schedule_swapped(out, budget)
            self._schedule_waiting(out, budget)
            self.shares.end_step()
            out.tier_offload, out.persist = self.kv.step_copies()
        except BaseException:
            self.kv.rollback()
            raise
        # Host blocks read by this step's swap-ins (or released by aborts) are
        # reused only from the next step on: the runner copies out before in.
        self.swap.free(self._host_to_free)
        self._host_to_free = []
        self._last_tokens = out.num_prefill_decode_tokens()
        return out

    def _demands(self) -> tuple[Counter, Counter, Counter]:
        """Per tenant: the tokens it could compute this step (running and swapped requests'
        chunks, waiting ones' uncached prompts), the seats it could fill, the seats it holds.
        A tenant's waiting requests are counted until they alone would fill the step."""
        tokens: Counter[Tenant] = Counter()
        seats: Counter[Tenant] = Counter()
        budget, max_seqs = self.config.token_budget, self.config.max_num_seqs
        for req in self.running + self.swapped:
            tokens[req.tenant] += self._chunk(req, budget) + len(self._drafts.get(req.request_id, ()))
            seats[req.tenant] += 1
        held = Counter(r.tenant for r in self.running)
        for req in self.waiting:
            t = req.tenant
            if req.waits_for_leader or (tokens[t] >= budget and seats[t] >= max_seqs):
                continue
            uncached = req.num_tokens - len(self.kv.get_computed_blocks(req)) * self.kv.block_size
            tokens[t] += min(uncached, budget)
            seats[t] += 1
        return tokens, seats, held

    def _cap(self, req: Request, budget: int) -> int:
        """The most tokens the request may take now: the step's budget left, within its
        tenant's allowance where prompts may be chunked (0: none this step)."""
        left = self.shares.left(req.tenant)
        if left <= 0:
            return 0
        return min(budget, left) if self.config.enable_chunked_prefill else budget

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            cap = self._cap(req, budget)
            if cap == 0:  # its tenant's allowance is spent: it waits for the next step
                i += 1
                continue
            n = self._chunk(req, cap)
            draft = self._drafted(req, n, cap)
            while not draft and self.kv.allocate_slots(req, n) is None:
                victim = self._victim(self.running[i:])
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.requests.append(self._scheduled(req, n, draft=draft))
                budget -= n + len(draft)
                i += 1
        return budget

    def _propose(self) -> dict[str, list[int]]:
        """This step's drafts of the running requests that decode (speculative decoding)."""
        if self.spec is None:
            return {}
        drafts = {r.request_id: self.spec.propose(r) for r in self.running}
        return {rid: d for rid, d in drafts.items() if d}

    def _drafted(self, req: Request, n: int, cap: int) -> list[int]:
        """The request's draft, cut to the tokens it may take, if its blocks (for its next
        token and the draft) could be allocated; else [] and nothing allocated."""
        draft = self._drafts.get(req.request_id, [])[:max(0, cap - n)] if n == 1 else []
        if draft and self.kv.allocate_slots(req, n + len(draft)) is None:
            return []  # no room for the draft: the request decodes one token as usual
        return draft

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        for req in list(self.swapped):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            cap = self._cap(req, budget)
            if cap == 0 or not self.shares.may_seat(req.tenant):
                continue
            n = self._chunk(req, cap)
            held = blocks_for_tokens(req.num_computed_tokens, self.kv.block_size)  # (as when it was swapped out)
            new = self.kv.allocate_slots(req, n)
            if new is None:
                break
            self.swapped.remove(req)
            device = self.kv.held_block_ids(req.request_id, held)
            _require(len(device) == len(req.host_block_ids), f"{req.request_id}: {len(device)} blocks to swap "
                     f"{len(req.host_block_ids)} host blocks into")
            out.swap_in.extend(zip(req.host_block_ids, device))
            self._host_to_free.extend(req.host_block_ids)
            req.host_block_ids = []
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(self._scheduled(req, n, seated=True))
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while they fit; one whose blocks are being
        read from disk is passed over (it waits without holding the step)."""
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            cap = self._cap(req, budget)
            if cap == 0 or req.waits_for_leader or not self.shares.may_seat(req.tenant):
                continue  # its tenant's share is taken, or its prompt is being computed by its first sample
            n = self._admit(req, out, cap)
            if n is None:
                return
            budget -= n

    def _admit(self, req: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Start a waiting request from its longest cached prefix (pool, then tiers):
        the tokens scheduled, 0 while its tier blocks are loading, None if it does
        not fit (nothing changed)."""
        hits = self.kv.get_computed_blocks(req)  # a waiting request holds no blocks
        run, loading = self.kv.tier_run(req, len(hits))
        if loading:
            return 0
        hit_tokens = (len(hits) + len(run)) * self.kv.block_size
        req.num_computed_tokens = hit_tokens
        n = self._chunk(req, budget)
        fits = n == req.num_tokens - hit_tokens or self.config.enable_chunked_prefill
        new = self.kv.allocate_slots(req, n, hits, len(run)) if fits else None
        if new is None:
            req.num_computed_tokens = 0
            return None
        first = req.num_cached_tokens is None  # stats count a request's first lookup only
        if self.kv.tiers is not None:  # (a grouped pool's window blocks may load without a run)
            out.tier_load.extend(self.kv.load_copies(run, new, first))
        if req.prompt_logprobs is not None and self.kv.logprobs is not None:
            self.kv.logprobs.fill(req, len(hits) + len(run))
        self.waiting.remove(req)
        if first:
            req.num_cached_tokens = hit_tokens
            self.kv.record_query(req.num_tokens, hit_tokens)
            self._device_hit_blocks += len(hits)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.requests.append(self._scheduled(req, n, seated=True))
        return n

    def _scheduled(self, req: Request, n: int, seated: bool = False, draft: list[int] | None = None
                   ) -> ScheduledRequest:
        """The request computes n more tokens this step, and its draft after them (taken
        from its tenant's allowance). Until update() it counts the draft as computed."""
        draft = draft or []
        self.shares.take(req.tenant, n + len(draft), seated)
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start:start + n] + draft
        req.num_computed_tokens += n
        sample = req.num_computed_tokens == req.num_tokens
        req.num_computed_tokens += len(draft)
        return ScheduledRequest(
            request_id=req.request_id, token_ids=tokens, start_pos=start,
            block_ids=self.kv.block_ids(req.request_id), group_block_ids=self.kv.group_block_ids(req.request_id),
            sample=sample,
            sampling_params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids, draft_token_ids=draft)

    def _victim(self, candidates: list[Request]) -> Request:
        """Whom to preempt among requests not yet scheduled this step (the one
        being scheduled included): a request already scheduled this step cannot
        be undone, since its new blocks are cached already and may be hit by a
        later request of the same step."""
        if self.config.scheduling_policy is SchedulingPolicy.PRIORITY:
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Swap the request's KV out to host memory (swap mode, if it fits),
        else free it for recomputation."""
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._step_preemptions += 1
        device = self.kv.held_block_ids(req.request_id, len(self.kv.block_ids(req.request_id)))  # every group's
        host = self.swap.allocate(len(device)) if self.config.preemption_mode is PreemptionMode.SWAP else None
        self.kv.free(req)
        if host is not None:
            out.swap_out.extend(zip(device, host))
            req.host_block_ids = host
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            return
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.push(req, front=True)

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """The step ran: commit its cache entries, append sampled tokens, finish
        requests that hit a stop condition, and fail the requests whose sampling
        failed (`result.failed`)."""
        self.kv.commit()
        outputs = self._finish_with_error(list(result.failed), result.failed)
        for sr in sched.requests:
            req = self.requests.get(sr.request_id)
            if req is not None and sr.request_id in result.prompt_logprobs:
                first, entries = result.prompt_logprobs[sr.request_id]
                req.record_prompt_logprobs(first, entries)
                if self.kv.logprobs is not None:
                    self.kv.logprobs.store(req, first, len(entries))
            if req is None or not sr.sample:
                continue
            if req.pin_prefix and not req.pinned:
                self._pin_prompt(req)
            if req.sampling_params.max_tokens == 0:  # the prompt only (its logprobs): done once it ran
                outputs.append(EngineCoreOutput(req.request_id, [], RequestStatus.FINISHED_LENGTH,
                                                prompt_logprobs=req.prompt_logprobs))
                self.finish_requests([req.request_id], RequestStatus.FINISHED_LENGTH)
                continue
            outputs.append(out := self._append(req, sr, result))
            if out.finished_status is not None:
                self.finish_requests([req.request_id], out.finished_status)
        for sr in sched.requests:  # a grouped pool's window blocks its requests have left behind
            if (req := self.requests.get(sr.request_id)) is not None and req.status is RequestStatus.RUNNING:
                self.kv.advance(req)
        return outputs

    def _append(self, req: Request, sr: ScheduledRequest, result: ModelRunnerOutput) -> EngineCoreOutput:
        """Append the step's tokens to a request (the draft tokens it keeps, then the sampled
        one), up to the first that stops it; release the KV of a draft's rejected tail."""
        rid = req.request_id
        kept = result.accepted_token_ids.get(rid, [])
        tokens = kept + [result.sampled_token_ids[rid]]
        lps = result.accepted_logprobs.get(rid, []) + ([result.logprobs[rid]] if rid in result.logprobs else [])
        if sr.draft_token_ids:
            self.spec.observe(rid, len(sr.draft_token_ids), len(kept))
            req.num_computed_tokens = sr.start_pos + 1 + len(kept)  # the KV written for the draft's kept tokens
            self.kv.trim(req)
        first = not req.output_token_ids and req.prompt_logprobs is not None
        status, added = None, 0
        for token in tokens:
            req.output_token_ids.append(token)
            added += 1
            if (status := req.check_token_stop()) is not None:
                break
        return EngineCoreOutput(rid, tokens[:added], status, req.stop_reason, lps[:added],
                                prompt_logprobs=list(req.prompt_logprobs) if first else None)

    def fail_step(self, sched: SchedulerOutput, error: str) -> list[EngineCoreOutput]:
        """The step could not run (its KV may be half written): forget the cache
        entries it made and fail the requests it scheduled; nothing else changes."""
        self.kv.rollback()
        return self._finish_with_error([r.request_id for r in sched.requests], {}, error)

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """Fail every unfinished request (after a bug in schedule() itself)."""
        self.kv.rollback()
        return self._finish_with_error(list(self.requests), {}, error)

    def _finish_with_error(self, request_ids: list[str], errors: dict[str, str],
                           default: str = "") -> list[EngineCoreOutput]:
        """Finish request_ids as failed: those in `errors` by their own fault (the model
        output's `failed`: their sampling or grammar), the rest with `default`."""
        outputs = []
        for rid in request_ids:
            if rid in self.requests:
                self.finish_requests([rid], RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(rid, [], RequestStatus.FINISHED_ERROR,
                                                error=errors.get(rid, default), error_own=rid in errors))
        return outputs

    def _pin_prompt(self, req: Request) -> None:
        """Pin the full blocks of a request's prompt once it is computed. A pin
        refused here (the limit was reached after admission) is logged, not fatal."""
        req.pinned = True
        try:
            self.kv.pin(req.block_hashes[:req.num_prompt_tokens // self.kv.block_size])
        except PinError as e:
            log.warning("request %s: prefix not pinned: %s", req.request_id, e)

    def make_stats(self) -> SchedulerStats:
        """The state now and what the last schedule() did; prefix-cache counters reset on read."""
        prefill, decode = self._last_tokens
        tiers = self.kv.tiers.make_stats() if self.kv.tiers is not None else TierStats()
        tiers.hit_blocks[Source.DEVICE] += self._device_hit_blocks
        self._device_hit_blocks = 0
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            num_preemptions=self._step_preemptions, num_preemptions_total=self.num_preemptions,
            num_prefill_tokens=prefill, num_decode_tokens=decode, kv_cache_usage=self.kv.usage(),
            swap_usage=self.swap.usage(), prefix_cache=self.kv.make_stats(), tiers=tiers,
            block_size=self.kv.block_size, spec=self.spec.make_stats() if self.spec is not None else None)

    def check_integrity(self) -> None:
        """Every running request holds exactly the blocks its computed tokens
        need; waiting and swapped ones hold no device blocks; host blocks add up."""
        self.kv.check_integrity()
        for req in self.running:
            have = len(self.kv.req_to_blocks.get(req.request_id, ()))
            need = -(-req.num_computed_tokens // self.kv.block_size)
            _require(have == need, f"{req.request_id}: {have} blocks for {req.num_computed_tokens} tokens")
        for req in list(self.waiting) + self.swapped:
            _require(req.request_id not in self.kv.req_to_blocks, f"{req.request_id} holds blocks while queued")
        host = [h for r in self.swapped for h in r.host_block_ids] + self._host_to_free
        _require(len(set(host)) == len(host), "a host block is held twice")
        _require(len(host) + self.swap.num_free == self.swap.num_blocks, "host blocks leaked")
        _require(len(self.requests) == len(self.running) + len(self.waiting) + len(self.swapped),
                 "a request is in no queue, or in two")


def _require(ok: bool, what: str) -> None:
    """IntegrityError unless ok (not `assert`: checks must hold under python -O too)."""
    if not ok:
        raise IntegrityError(what)
