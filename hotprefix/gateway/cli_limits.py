"""The flags of `hotprefix gateway` for keys' defaults, timeouts, identity and warm-up."""

from __future__ import annotations

import argparse
import os


def add_gateway_limits(gw: argparse.ArgumentParser) -> None:
    """The gateway's defaults for keys, its timeouts, its identity and its warm-up."""
    gw.add_argument("--default-rpm", type=int, default=None, help="requests per minute for keys that set none")
    gw.add_argument("--default-tpm", type=int, default=None, help="tokens per minute for keys that set none")
    gw.add_argument("--default-max-concurrent", type=int, default=None,
                    help="concurrent requests for keys that set none")
    gw.add_argument("--default-max-tokens", type=int, default=512,
                    help="max_tokens of a request that sets none (every forwarded request carries one, also cut to "
                         "the key's token budget and the model's context)")
    gw.add_argument("--backend-timeout", type=float, default=600.0,
                    help="seconds a backend may take to send its next bytes; then 504 (the backend is not marked "
                         "down and the request is not sent again)")
    gw.add_argument("--gateway-id", default=None,
                    help="this gateway's name in usage rows (default HOST:PORT); restarted with the same id, it "
                         "closes the rows its previous run left running")
    gw.add_argument("--heartbeat", type=float, default=5.0,
                    help="seconds between renewals of running requests' leases and usage checkpoints")
    gw.add_argument("--metrics-key", default=os.environ.get("HOTPREFIX_METRICS_KEY"),
                    help="bearer key of /metrics (env HOTPREFIX_METRICS_KEY; default: the admin key)")
    gw.add_argument("--max-request-body-bytes", default="4MiB", help="a larger request body gets 413")
    gw.add_argument("--auth-cache-s", type=float, default=5.0,
                    help="seconds a key lookup is reused (revocations by other processes apply within this)")
    gw.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="send every tenant's prompt to its backend when the backend comes up, and pin it")
