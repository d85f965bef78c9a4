"""Errors raised for bad requests (the server maps them to HTTP statuses), and for a
model that cannot be loaded. Below every other module: anyone may raise them."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model cannot be loaded; the message is one line naming what was wrong."""


class PeerLostError(RuntimeError):
    """A tensor-parallel peer rank is gone (it died, hung past the step timeout, or never
    came): the engine cannot step again. The message is one line."""


class PinError(ValueError):
    """A pin cannot be taken: the prefix is not cached, or the pin limit would be exceeded."""


class InvalidRequestError(ValueError):
    """The request cannot be served as given (HTTP 400). The message says why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotFoundError(InvalidRequestError):
    """The request names something not kept here, or not its own (HTTP 404)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context."""

    def __init__(self, max_model_len: int, num_prompt_tokens: int, max_tokens: int | None = None) -> None:
        msg = (f"This model's maximum context length is {max_model_len} tokens. However, your request has "
               f"{num_prompt_tokens} input tokens")
        if max_tokens is not None:
            msg = (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                   f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, "
                   f"{max_tokens} in the completion)")
        super().__init__(msg + ". Please reduce the length of the input.", param="messages")
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens


class QueueFullError(RuntimeError):
    """Admitting the request would put more than --max-num-queued-requests
    sequences in the queue (HTTP 503 with Retry-After)."""


class RequestFailedError(RuntimeError):
    """This request alone failed inside the engine (every other request goes on). The
    message says why; `own`: by its own fault (its grammar, its sampling parameters:
    HTTP 400, not retried by a gateway), else an internal error (HTTP 500)."""

    def __init__(self, message: str, own: bool = False) -> None:
        super().__init__(message)
        self.own = own
