"""`hotprefix gateway` settings (frozen; validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass

from hotprefix.config import ConfigError


@dataclass(frozen=True)
class GatewayConfig:
    """backends: base URLs of OpenAI-compatible servers (hotprefix, vLLM, llama.cpp).
    default_*: limits for keys that set none (None: unlimited).
    reserve_max_tokens: tokens reserved for the output when a request sets no max_tokens.
    auth_cache_s: how long a looked-up key is trusted before the database is asked again
    (revocation through another process takes effect within this time).
    """

    backends: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    database_url: str | None = None
    redis_url: str | None = None
    admin_key: str | None = None
    secret_file: str | None = None
    backend_api_key: str | None = None
    health_interval: float = 2.0
    load_factor: float = 1.25
    min_cap: int = 4
    default_rpm: int | None = None
    default_tpm: int | None = None
    default_max_concurrent: int | None = None
    reserve_max_tokens: int = 512
    auth_cache_s: float = 5.0
    upstream_timeout: float = 600.0
    warmup: bool = True
    log_level: str = "info"

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
        for name in ("default_rpm", "default_tpm", "default_max_concurrent"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.admin_key is not None and len(self.admin_key) < 16:
            raise ConfigError("--admin-key must be at least 16 characters")
