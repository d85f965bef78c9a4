"""Plain data passed between the scheduler and the model runner (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hotprefix.core.request import RequestStatus
from hotprefix.sampling_params import SamplingParams, TokenLogprobs


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions
    `start_pos .. start_pos + len(token_ids) - 1`, whose KV goes into the
    slots given by `block_ids`; sample a token after the last one if `sample`.

    prompt_token_ids / output_token_ids are the request's lists (read-only for
    the runner; used by penalties)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # speculative decoding (core/speculation.py): the last len(draft_token_ids) of token_ids are a
    # draft to verify; the runner samples the last len(draft_token_ids) + 1 positions in order
    draft_token_ids: list[int] = field(default_factory=list)
    # a grouped pool (core/kv_groups.py): every KV-cache group's block table, the full group's
    # (block_ids) first; a window group's released blocks are the pool's null block id. () for one group.
    group_block_ids: tuple[list[int], ...] = ()


@dataclass
class SchedulerOutput:
    """What one engine step computes. Requests keep the scheduler's order.

    Before the forward pass the runner copies, in this order: tier_offload
    (device block, host-tier slot) out, swap_out (device block, swap block) out,
    swap_in (swap block, device block) in, tier_load (host-tier slot, device block)
    in. Once the step ran, the engine hands the blocks of `persist` (device block,
    hash), whose KV is then computed, to the disk tier."""

    requests: list[ScheduledRequest] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    tier_offload: list[tuple[int, int]] = field(default_factory=list)
    tier_load: list[tuple[int, int]] = field(default_factory=list)
    persist: list[tuple[int, bytes]] = field(default_factory=list)

    def num_prefill_decode_tokens(self) -> tuple[int, int]:
        """(prefill, decode) tokens: a decode is one new token after the prompt (and its
        draft, with speculative decoding); everything else (prompt chunks, recomputation
        after preemption) is prefill."""
        decode = sum(len(r.token_ids) for r in self.requests
                     if len(r.token_ids) == 1 + len(r.draft_token_ids) and r.start_pos >= len(r.prompt_token_ids))
        return self.num_scheduled_tokens - decode, decode

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not (self.requests or self.swap_out or self.swap_in or self.tier_offload or self.tier_load)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens for the requests that asked for one (by request id), and
    the requests whose own sampling failed (id -> why): those get no token. A request
    that verified a draft also has the draft tokens it keeps, which come before its
    sampled token."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # requests with prompt_logprobs: (the prompt position of the first entry, the entries)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    # speculative decoding: the draft tokens each request keeps (before its sampled token) and their logprobs
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """A request's progress after one step: its new token, and its status if it
    finished (with `error` saying why when the status is FINISHED_ERROR)."""

    request_id: str
    new_token_ids: list[int]
    finished_status: RequestStatus | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None
    error_own: bool = False  # the failure is the request's own (its sampling parameters or its grammar)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with its first token, when asked for

    @property
    def finished(self) -> bool:
        return self.finished_status is not None
