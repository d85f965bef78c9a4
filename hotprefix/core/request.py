"""A request as the scheduler sees it: token ids and progress, no text, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hotprefix.core.hashing import UNSALTED, BlockHash, CacheScope
from hotprefix.sampling_params import SamplingParams, TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # this request alone failed (its step, its sampling or its output)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason for a finished status, else None."""
        return self.value if self.finished else None


@dataclass(eq=False)
class Request:
    """One sequence to generate.

    The single scheduling rule: every step, `num_computed_tokens` catches up
    towards `num_tokens` (prompt plus output so far) within the step's budget.
    A prefill chunk and a decode token are the same thing to the scheduler.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    cache_scope: CacheScope = UNSALTED  # prefix caching: the blocks it may share (see CacheScope)
    pin_prefix: bool = False
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens served from cache at first scheduling
    num_preemptions: int = 0
    pinned: bool = False
    host_block_ids: list[int] = field(default_factory=list)  # KV swapped out to host memory
    # with sampling_params.prompt_logprobs: entry i is prompt token i's (None for the first, and until computed)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    tenant: str | None = None  # whose share of each step it takes (core/fairness.py); None: one shared tenant
    # n > 1: the first sample, whose prompt this one waits for (it then starts from its cached blocks)
    follows: Request | None = None

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def waits_for_leader(self) -> bool:
        """Whether the sample it follows is still computing the prompt they share."""
        lead = self.follows
        return lead is not None and not lead.status.finished and lead.num_computed_tokens < lead.num_prompt_tokens

    def needs_prompt_logprob(self, position: int) -> bool:
        """Whether prompt token `position`'s logprob is asked for and not yet recorded."""
        lps = self.prompt_logprobs
        return lps is not None and 0 < position < len(lps) and lps[position] is None

    def record_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """Prompt tokens first.. 's logprobs, computed by a step (again, after a
        preemption: the first computation is kept)."""
        assert self.prompt_logprobs is not None
        for i, e in enumerate(entries, first):
            if self.prompt_logprobs[i] is None:
                self.prompt_logprobs[i] = e

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_at(self, index: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    def check_token_stop(self) -> RequestStatus | None:
        """After appending an output token: the finished status it causes, if any.

        Sets `stop_reason` to the stop token id when a stop_token_id matched.
        """
        sp = self.sampling_params
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        # before min_tokens the sampler lets a structured output sample a stop token only when
        # its grammar allows nothing else (sampler.min_tokens_suppressed): the grammar wins, it stops
        if n_out >= sp.min_tokens or sp.structured is not None:
            if not sp.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
