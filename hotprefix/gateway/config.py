"""`hotprefix gateway` settings (frozen; validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hotprefix.config import KEEP_ALIVE_S, ConfigError
from hotprefix.gateway.budgets import PriceTable


@dataclass(frozen=True)
class GatewayConfig:
    """backends: base URLs of OpenAI-compatible servers (hotprefix, vLLM, llama.cpp).
    default_*: limits for keys that set none (None: unlimited).
    default_max_tokens: the max_tokens of a request that sets none (every forwarded
    request carries an explicit one, also cut to the key's token budget and the model).
    auth_cache_s: how long a looked-up key is trusted before the database is asked again
    (revocation through another process takes effect within this time).
    backend_timeout: seconds a backend may take to send the next bytes (then 504).
    gateway_id: this gateway's name in usage rows; a restarted gateway with the same
    id closes the rows its previous run left running.
    heartbeat_s: how often running requests renew their leases and checkpoint usage.
    metrics_key: bearer key of /metrics (default: the admin key; neither: /metrics is off).
    backend_admin_key: the backends' --admin-api-key, for /pin (warm-up) and a request's usage
    by id (default: backend_api_key).
    docs: serve /docs, /redoc and /openapi.json (off: the Swagger page loads from a CDN).
    max_request_body_bytes: a larger request body gets 413.
    prices: per model, the price per million tokens (budgets in money, and spend reports).
    """

    backends: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    database_url: str | None = None
    redis_url: str | None = None
    admin_key: str | None = None
    secret_file: str | None = None
    backend_api_key: str | None = None
    backend_admin_key: str | None = None
    health_interval: float = 2.0
    health_fails: int = 3
    timeout_keep_alive: float = KEEP_ALIVE_S
    load_factor: float = 1.25
    min_cap: int = 4
    default_rpm: int | None = None
    default_tpm: int | None = None
    default_max_concurrent: int | None = None
    default_max_tokens: int = 512
    auth_cache_s: float = 5.0
    backend_timeout: float = 600.0
    gateway_id: str = "gateway"
    heartbeat_s: float = 5.0
    metrics_key: str | None = None
    max_request_body_bytes: int = 4 << 20
    warmup: bool = True
    prices: PriceTable = field(default_factory=PriceTable)
    log_level: str = "info"
    docs: bool = False

    def backend_headers(self, admin: bool = False) -> dict[str, str]:
        """The Authorization header for a backend: its client key, or (admin) its operator key."""
        key = (self.backend_admin_key or self.backend_api_key) if admin else self.backend_api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    @property
    def health_timeout(self) -> float:
        """How long one health check may take: twice the interval, within 1-5 seconds."""
        return max(1.0, min(5.0, 2 * self.health_interval))

    @property
    def lease_s(self) -> float:
        """How long a concurrency lease lives without a heartbeat (a dead gateway's
        leases end after this)."""
        return 6 * self.heartbeat_s + 30

    @property
    def orphan_after_s(self) -> float:
        """A `started` usage row no heartbeat touched for this long belongs to a dead gateway."""
        return 12 * self.heartbeat_s + 60

    def __post_init__(self) -> None:
        if not self.backends:
            raise ConfigError("give at least one --backend URL")
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--backend must be an http(s) URL, got {url!r}")
        if len(set(self.backends)) != len(self.backends):
            raise ConfigError("a --backend is given twice")
        if self.load_factor < 1:
            raise ConfigError(f"--load-factor must be >= 1, got {self.load_factor}")
        if self.min_cap < 1:
            raise ConfigError(f"--load-min-cap must be >= 1, got {self.min_cap}")
        if self.health_interval <= 0:
            raise ConfigError(f"--health-interval must be > 0, got {self.health_interval}")
        if not self.timeout_keep_alive > 0:
            raise ConfigError(f"--timeout-keep-alive must be > 0, got {self.timeout_keep_alive}")
        if self.health_fails < 1:
            raise ConfigError(f"--health-fails must be >= 1, got {self.health_fails}")
        for name in ("default_rpm", "default_tpm", "default_max_concurrent"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        for flag, key in (("--admin-key", self.admin_key), ("--metrics-key", self.metrics_key)):
            if key is not None and len(key) < 16:
                raise ConfigError(f"{flag} must be at least 16 characters")
        for flag, v in (("--backend-timeout", self.backend_timeout), ("--heartbeat", self.heartbeat_s)):
            if not v > 0:
                raise ConfigError(f"{flag} must be > 0, got {v}")
        if self.default_max_tokens < 1 or self.max_request_body_bytes < 1:
            raise ConfigError("--default-max-tokens and --max-request-body-bytes must be >= 1")
