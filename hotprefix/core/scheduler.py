"""The scheduler: which requests run each step and how many tokens each computes.

One rule: every step, each chosen request's `num_computed_tokens` catches up
towards `num_tokens` within the step's token budget (chunked prefill). Running
requests are served before waiting ones. When the pool runs out of blocks, the
running request admitted last is preempted (its blocks are freed and it is
recomputed later from its prompt and the output it already has, looking the
prefix cache up again).

A waiting request starts from its longest cached prefix (see kv_cache_manager):
only the uncached tokens are scheduled.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from hotprefix.config import SchedulerConfig
from hotprefix.core.kv_cache_manager import KVCacheManager, PinError
from hotprefix.core.outputs import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from hotprefix.core.request import Request, RequestStatus

log = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager.

    `schedule()` mutates requests' `num_computed_tokens` and status and takes
    blocks; `update()` appends sampled tokens and frees finished requests.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError for a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish (or abort) requests in any state, returning all their blocks.
        Unknown or already finished ids are ignored."""
        assert status.finished
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self.kv.free(req)
            self._finished_ids.add(rid)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:  # nothing to compute (cannot happen after update())
                i += 1
                continue
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                out.requests.append(self._scheduled(req, n))
                budget -= n
                i += 1

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.get_computed_blocks(req)  # a fresh or preempted request holds no blocks
            hit_tokens = len(hits) * self.kv.block_size
            n = req.num_tokens - hit_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = hit_tokens
            if req.num_cached_tokens is None:  # stats count a request's first lookup only
                req.num_cached_tokens = hit_tokens
                self.kv.record_query(req.num_tokens, hit_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(self._scheduled(req, n))
            budget -= n
        return out

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start:start + n]
        req.num_computed_tokens += n
        return ScheduledRequest(
            request_id=req.request_id, token_ids=tokens, start_pos=start,
            block_ids=self.kv.block_ids(req.request_id),
            sample=req.num_computed_tokens == req.num_tokens,
            sampling_params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids)

    def _preempt(self, req: Request) -> None:
        """Recompute-mode preemption: free the blocks, requeue at the front."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish requests that hit a stop condition."""
        outputs: list[EngineCoreOutput] = []
        for sr in sched.requests:
            req = self.requests.get(sr.request_id)
            if req is None or not sr.sample:
                continue
            if req.pin_prefix and not req.pinned:
                self._pin_prompt(req)
            token = result.sampled_token_ids[sr.request_id]
            req.output_token_ids.append(token)
            status = req.check_token_stop()
            lp = result.logprobs.get(sr.request_id)
            outputs.append(EngineCoreOutput(req.request_id, [token], status, req.stop_reason,
                                            [lp] if lp is not None else []))
            if status is not None:
                self.finish_requests([req.request_id], status)
        return outputs

    def _pin_prompt(self, req: Request) -> None:
        """Pin the full blocks of a request's prompt once it is computed. A pin
        refused here (the limit was reached after admission) is logged, not fatal."""
        req.pinned = True
        try:
            self.kv.pin(req.block_hashes[:req.num_prompt_tokens // self.kv.block_size])
        except PinError as e:
            log.warning("request %s: prefix not pinned: %s", req.request_id, e)

    def check_integrity(self) -> None:
        """Every running request holds exactly the blocks its computed tokens need."""
        self.kv.check_integrity()
        for req in self.running:
            have = len(self.kv.req_to_blocks.get(req.request_id, ()))
            need = -(-req.num_computed_tokens // self.kv.block_size)
            assert have == need, f"{req.request_id}: {have} blocks for {req.num_computed_tokens} tokens"
        for req in self.waiting:
            assert req.request_id not in self.kv.req_to_blocks, f"waiting {req.request_id} holds blocks"
