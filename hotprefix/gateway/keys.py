"""API keys: `sk-hp-` + 192 random bits, stored only as HMAC-SHA256 under a server secret.

The secret comes from $HOTPREFIX_GATEWAY_SECRET or a file (created once, mode
0600) so that `hotprefix keys create` and `hotprefix gateway` agree on digests.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from hotprefix.config import ConfigError

KEY_PREFIX = "sk-hp-"
SECRET_ENV = "HOTPREFIX_GATEWAY_SECRET"


def home() -> Path:
    """Where the gateway keeps its default database and secret: $HOTPREFIX_HOME or ~/.hotprefix."""
    return Path(os.environ.get("HOTPREFIX_HOME") or Path.home() / ".hotprefix")


def default_database_url() -> str:
    return os.environ.get("HOTPREFIX_DATABASE_URL") or f"sqlite:///{home() / 'gateway.db'}"


def load_secret(path: str | None = None) -> bytes:
    """The HMAC secret: the env var if set, else the file at `path` (default
    ~/.hotprefix/gateway.secret), created with 32 random bytes when missing.
    Raises ConfigError when the file cannot be read or is too short."""
    env = os.environ.get(SECRET_ENV)
    if env:
        if len(env) < 16:
            raise ConfigError(f"${SECRET_ENV} must be at least 16 characters")
        return env.encode()
    p = Path(path) if path else home() / "gateway.secret"
    try:
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        value = p.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the gateway secret {p}: {e}") from None
    if len(value) < 16:
        raise ConfigError(f"the gateway secret in {p} is shorter than 16 characters")
    return value.encode()


def new_key() -> str:
    """A fresh key: the prefix and 32 url-safe characters (192 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(24)


def new_key_id() -> str:
    """A public key id (not secret): shown in lists and usage rows."""
    return "key_" + secrets.token_hex(8)


def digest(secret: bytes, key: str) -> str:
    """HMAC-SHA256(secret, key) as hex: the only form of a key that is stored."""
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The cache salt of a tenant: derived from the secret, so no client can guess
    or forge another tenant's."""
    return hmac.new(secret, b"cache-salt:" + tenant.encode(), hashlib.sha256).hexdigest()
