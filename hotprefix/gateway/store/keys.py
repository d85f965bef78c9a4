"""API keys: created, listed, authenticated (by HMAC digest only), revoked and rotated."""

from __future__ import annotations

import datetime as dt
import hmac
import json
from dataclasses import dataclass, fields
from typing import Any

import sqlalchemy as sa

from hotprefix.gateway import keys as K
from hotprefix.gateway.budgets import Budget
from hotprefix.gateway.budgets import parse_duration as parse_budget_duration
from hotprefix.gateway.schema import api_keys, tenants
from hotprefix.gateway.store.database import NotFound, StoreError, from_columns, utcnow
from hotprefix.gateway.store.tenants import TenantStore

MAX_GRACE_S = 365 * 86400.0  # a rotated key's grace period: at most a year


@dataclass(frozen=True)
class KeyRecord:
    """An API key's record (the api_keys columns by name, and its tenant's name); the
    store holds no secret, only the key's digest, which is not part of the record."""

    id: str
    tenant: str
    tenant_id: int
    name: str | None
    hint: str
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    rotated_from: str | None
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    max_budget_tokens: int | None = None
    max_budget: float | None = None
    budget_duration: str | None = None
    models: tuple[str, ...] | None = None  # the models it may use (None: any)

    @classmethod
    def from_row(cls, row: sa.RowMapping) -> KeyRecord:
        """The record of a row of `api_keys` joined with its tenant's name (as `tenant`)."""
        models = row["models"]
        return from_columns(cls, row, models=None if models is None else tuple(json.loads(models)))

    @property
    def budget(self) -> Budget:
        return Budget(self.max_budget_tokens, self.max_budget, parse_budget_duration(self.budget_duration))

    def active(self, at: dt.datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > at)

    def public(self) -> dict[str, Any]:
        """The record as JSON-able data (no secret in it: the store holds none)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("created_at", "expires_at", "revoked_at"):
            d[k] = d[k].isoformat() + "Z" if d[k] else None
        d["models"] = None if self.models is None else list(self.models)
        return d


class KeyStore(TenantStore):
    """API keys (a key belongs to a tenant)."""

    def create_key(self, secret: bytes, tenant: str, name: str | None = None,
                   expires_at: dt.datetime | None = None, rpm: int | None = None, tpm: int | None = None,
                   max_concurrent: int | None = None) -> tuple[str, KeyRecord]:
        """A new key for `tenant`: returns (the key, shown this once; its record)."""
        with self.engine.begin() as c:
            key, kid = self._insert_key(c, secret, tenant, name, expires_at, rpm, tpm, max_concurrent, None)
        return key, self.key(kid)

    def _insert_key(self, c, secret: bytes, tenant: str, name: str | None, expires_at: dt.datetime | None,
                    rpm: int | None, tpm: int | None, max_concurrent: int | None,
                    rotated_from: str | None) -> tuple[str, str]:
        t = self.tenant(tenant)
        for v, flag in ((rpm, "rpm"), (tpm, "tpm"), (max_concurrent, "max-concurrent")):
            if v is not None and v < 1:
                raise StoreError(f"--{flag} must be >= 1")
        key, kid = K.new_key(), K.new_key_id()
        c.execute(api_keys.insert().values(id=kid, digest=K.digest(secret, key), hint=key[-4:], tenant_id=t.id,
                                           name=name, created_at=utcnow(), expires_at=expires_at,
                                           rotated_from=rotated_from, rpm=rpm, tpm=tpm,
                                           max_concurrent=max_concurrent))
        return key, kid

    def _keys_query(self):
        return sa.select(api_keys, tenants.c.name.label("tenant")).join(tenants, tenants.c.id == api_keys.c.tenant_id)

    def key(self, key_id: str) -> KeyRecord:
        with self.engine.connect() as c:
            r = c.execute(self._keys_query().where(api_keys.c.id == key_id)).mappings().first()
        if r is None:
            raise NotFound(f"no key {key_id!r}")
        return KeyRecord.from_row(r)

    def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        q = self._keys_query().order_by(api_keys.c.created_at)
        if tenant is not None:
            q = q.where(tenants.c.name == tenant)
        with self.engine.connect() as c:
            return [KeyRecord.from_row(r) for r in c.execute(q).mappings()]

    def authenticate(self, secret: bytes, key: str) -> KeyRecord | None:
        """The active record of `key`, or None (unknown, revoked or expired). The
        lookup is by HMAC digest, which reveals nothing of the key; the final
        comparison is constant-time."""
        d = K.digest(secret, key)
        with self.engine.connect() as c:
            r = c.execute(self._keys_query().where(api_keys.c.digest == d)).mappings().first()
        if r is None or not hmac.compare_digest(r["digest"], d):
            return None
        rec = KeyRecord.from_row(r)
        return rec if rec.active(utcnow()) else None

    def revoke_key(self, key_id: str) -> KeyRecord:
        """Revoke now (idempotent). Raises StoreError for an unknown id."""
        with self.engine.begin() as c:
            c.execute(api_keys.update().where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                      .values(revoked_at=utcnow()))
        return self.key(key_id)  # raises StoreError for an unknown id

    def rotate_key(self, secret: bytes, key_id: str, grace_s: float = 0.0) -> tuple[str, KeyRecord]:
        """A new key with the old one's tenant, name and limits; the old one stops
        working after `grace_s` seconds (now when 0), at most MAX_GRACE_S. Both
        happen in one transaction. Raises StoreError for an unknown or inactive
        key or a grace out of range (then nothing changed)."""
        if not 0 <= grace_s <= MAX_GRACE_S:
            raise StoreError(f"the grace period must be between 0 and {MAX_GRACE_S:.0f} seconds, got {grace_s}")
        old = self.key(key_id)
        now = utcnow()
        if not old.active(now):
            raise StoreError(f"key {key_id!r} is revoked or expired")
        ends = now + dt.timedelta(seconds=grace_s)
        change = {"expires_at": ends} if grace_s > 0 else {"revoked_at": now}
        with self.engine.begin() as c:
            key, kid = self._insert_key(c, secret, old.tenant, old.name, old.expires_at, old.rpm, old.tpm,
                                        old.max_concurrent, old.id)
            c.execute(api_keys.update().where(api_keys.c.id == kid).values(
                max_budget_tokens=old.max_budget_tokens, max_budget=old.max_budget,
                budget_duration=old.budget_duration, models=None if old.models is None else json.dumps(old.models)))
            c.execute(api_keys.update().where(api_keys.c.id == key_id).values(**change))
        return key, self.key(kid)
