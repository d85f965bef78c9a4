"""What the engine returns for a request after each step: its samples so far and their
timing (LLMEngine.step, AsyncEngine's streams, the server's formats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hotprefix.sampling_params import TokenLogprobs


@dataclass
class CompletionOutput:
    """One of the n samples of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # why, when finish_reason is "error" (this sample alone failed)
    error_own: bool = False  # and the failure was its own (its sampling parameters, its grammar)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of a request after a step. `deltas[i]` and `new_token_ids[i]`
    are what this step added to sample i (for streaming). `outputs` are copies
    (their token lists are still the engine's own until the request finishes:
    read, never modify, them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    deltas: list[str]
    finished: bool
    new_token_ids: list[list[int]] = field(default_factory=list)
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # prompt_logprobs: entry i for prompt token i
    # once finished: the block hashes of the first sample's full blocks (prompt, then output;
    # empty without prefix caching), for the request log and the prefix-group view
    block_hashes: list[bytes] = field(default_factory=list)
