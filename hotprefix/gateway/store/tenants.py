"""Tenants, the pool of system prompts, and the budgets of tenants and keys."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from hotprefix.config import ConfigError
from hotprefix.gateway.budgets import Budget
from hotprefix.gateway.budgets import parse_duration as parse_budget_duration
from hotprefix.gateway.schema import api_keys, system_prompts, tenants
from hotprefix.gateway.store.database import Database, NotFound, StoreError, from_columns, utcnow

MAX_MODELS = 100  # models one key may be limited to


@dataclass(frozen=True)
class Prompt:
    name: str
    version: int
    text: str
    public: bool


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str
    prompt_name: str | None
    max_budget_tokens: int | None = None
    max_budget: float | None = None
    budget_duration: str | None = None

    @property
    def budget(self) -> Budget:
        return Budget(self.max_budget_tokens, self.max_budget, parse_budget_duration(self.budget_duration))


def check_budget(tokens: int | None, money: float | None, duration: str | None) -> Budget:
    """The budget these values make. Raises StoreError (an HTTP 400) for a bad one."""
    try:
        return Budget(tokens, money, parse_budget_duration(duration))
    except ConfigError as e:
        raise StoreError(str(e)) from None


class TenantStore(Database):
    """Prompts and tenants (and every budget)."""

    def add_prompt(self, name: str, text: str, public: bool) -> Prompt:
        """Add a new version of pool prompt `name` (version 1 when new)."""
        if not name or not text:
            raise StoreError("a prompt needs a name and a non-empty text")
        with self.engine.begin() as c:
            last = c.execute(sa.select(sa.func.max(system_prompts.c.version))
                             .where(system_prompts.c.name == name)).scalar()
            version = (last or 0) + 1
            c.execute(system_prompts.insert().values(name=name, version=version, text=text, public=public,
                                                     created_at=utcnow()))
        return Prompt(name, version, text, public)

    def prompt(self, name: str, version: int | None = None) -> Prompt:
        """Pool prompt `name` at `version` (default: the newest). Raises StoreError when unknown."""
        q = sa.select(system_prompts).where(system_prompts.c.name == name)
        q = q.where(system_prompts.c.version == version) if version else q.order_by(
            system_prompts.c.version.desc()).limit(1)
        with self.engine.connect() as c:
            row = c.execute(q).mappings().first()
        if row is None:
            raise NotFound(f"no system prompt {name!r}" + (f" version {version}" if version else ""))
        return from_columns(Prompt, row)

    def list_prompts(self) -> list[dict[str, Any]]:
        with self.engine.connect() as c:
            rows = c.execute(sa.select(system_prompts).order_by(system_prompts.c.name,
                                                                 system_prompts.c.version)).all()
        return [{"name": r.name, "version": r.version, "public": r.public, "chars": len(r.text),
                 "created_at": r.created_at.isoformat() + "Z"} for r in rows]

    def create_tenant(self, name: str, prompt_name: str | None = None) -> Tenant:
        """A new tenant, optionally using pool prompt `prompt_name`. Raises StoreError
        on a duplicate name or an unknown prompt."""
        if not name:
            raise StoreError("a tenant needs a name")
        if prompt_name is not None:
            self.prompt(prompt_name)
        try:
            with self.engine.begin() as c:
                c.execute(tenants.insert().values(name=name, prompt_name=prompt_name, created_at=utcnow()))
        except IntegrityError:
            raise StoreError(f"tenant {name!r} exists") from None
        return self.tenant(name)

    def set_tenant_prompt(self, name: str, prompt_name: str | None) -> Tenant:
        """Point tenant `name` at pool prompt `prompt_name` (None: no forced prompt)."""
        if prompt_name is not None:
            self.prompt(prompt_name)
        with self.engine.begin() as c:
            n = c.execute(tenants.update().where(tenants.c.name == name).values(prompt_name=prompt_name)).rowcount
        if not n:
            raise NotFound(f"no tenant {name!r}")
        return self.tenant(name)

    def tenant(self, name: str) -> Tenant:
        with self.engine.connect() as c:
            row = c.execute(sa.select(tenants).where(tenants.c.name == name)).mappings().first()
        if row is None:
            raise NotFound(f"no tenant {name!r}")
        return from_columns(Tenant, row)

    def list_tenants(self) -> list[Tenant]:
        with self.engine.connect() as c:
            rows = c.execute(sa.select(tenants).order_by(tenants.c.name)).mappings()
            return [from_columns(Tenant, r) for r in rows]

    def tenant_prompt(self, tenant: Tenant) -> Prompt | None:
        """The newest version of the tenant's pool prompt, or None."""
        return None if tenant.prompt_name is None else self.prompt(tenant.prompt_name)

    def set_budget(self, *, tenant: str | None = None, key_id: str | None = None, tokens: int | None = None,
                   money: float | None = None, duration: str | None = None,
                   models: list[str] | None = None) -> None:
        """Replace the budget of a tenant or a key (None: no cap), and a key's models (None:
        any). Raises StoreError for a bad value (nothing changes) or NotFound."""
        check_budget(tokens, money, duration)
        values: dict[str, Any] = {"max_budget_tokens": tokens, "max_budget": money, "budget_duration": duration}
        if key_id is not None:
            if models is not None and (len(models) > MAX_MODELS or not all(
                    isinstance(m, str) and 0 < len(m) <= 256 for m in models)):
                raise StoreError(f"models: at most {MAX_MODELS} names of 1-256 characters")
            values["models"] = None if models is None else json.dumps(list(models))
        table, cond = ((api_keys, api_keys.c.id == key_id) if key_id is not None
                       else (tenants, tenants.c.name == tenant))
        with self.engine.begin() as c:
            if not c.execute(table.update().where(cond).values(**values)).rowcount:
                raise NotFound(f"no {'key' if key_id is not None else 'tenant'} {key_id or tenant!r}")
