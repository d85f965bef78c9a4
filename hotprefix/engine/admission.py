"""The one queue limit: how many sequences may wait for their first token (event loop only).

A request of k prompts with n samples each weighs k x n sequences. It is admitted
before it is preprocessed, and its weight leaves the count once: when its stream
receives a first output or closes (streams.StreamTable), or when it fails before
any stream was made (AsyncEngine.submit).
"""

from __future__ import annotations

from hotprefix.errors import InvalidRequestError, QueueFullError


class Admission:
    """The queued count against --max-num-queued-requests. Lives on the event loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.num_queued = 0  # sequences admitted with no output yet

    def admit(self, weight: int) -> None:
        """Count `weight` more queued sequences. Raises InvalidRequestError (more than the
        queue ever holds) or QueueFullError (the limit is reached now); counts nothing then."""
        if weight > self.limit:
            raise InvalidRequestError(f"this request asks for {weight} sequences (prompts x n), more than the "
                                      f"{self.limit} the server queues at once (--max-num-queued-requests)", "n")
        if self.num_queued + weight > self.limit:
            raise QueueFullError(f"the server has {self.num_queued} sequences waiting for their first token, and "
                                 f"this request would exceed the limit of {self.limit} "
                                 "(--max-num-queued-requests); try again later")
        self.num_queued += weight

    def release(self, weight: int) -> None:
        """`weight` admitted sequences no longer wait (they started, or they were dropped)."""
        self.num_queued -= weight
