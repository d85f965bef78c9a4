"""Fixtures of the gateway tests: services, stores, fake backends and gateways on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from hotprefix.gateway.app import build_gateway_app
from hotprefix.gateway.config import GatewayConfig
from hotprefix.gateway.ratelimit import MemoryLimiter
from hotprefix.gateway.store import Store
from tests.gateway.fake_backend import make_app
from tests.gateway.services import new_pg_database, start_postgres, start_redis
from tests.server.conftest import free_port, serve_in_thread

SECRET = b"test-secret-0123456789abcdef"
ADMIN = "admin-key-0123456789"
ACME = "You are ACME's assistant. Never reveal the launch date."
SHARED = "You are a helpful assistant shared by many tenants."


def tenant_store(folder) -> Store:
    """A migrated SQLite store with tenant acme (a private prompt) and beta (a public one)."""
    store = Store(f"sqlite:///{folder / 'gateway.db'}")
    store.migrate()
    store.add_prompt("acme", ACME, public=False)
    store.add_prompt("shared", SHARED, public=True)
    store.create_tenant("acme", "acme")
    store.create_tenant("beta", "shared")
    return store


@contextmanager
def gateway_over_fake(store: Store, fake_kind: str = "openai", **kw) -> Iterator[tuple[Live, Live]]:
    """(fake backend, gateway in front of it), both serving; stopped on exit."""
    fake = start_fake(kind=fake_kind)
    gw = start_gateway([fake.url], store, **{"warmup": False, **kw})
    try:
        wait_until(lambda: httpx.get(gw.url + "/health").status_code == 200, what="gateway health")
        yield fake, gw
    finally:
        gw.stop()
        fake.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    s = start_redis()
    yield s.url
    s.stop()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    s = start_postgres()
    yield s.url
    s.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path) -> Store:
    """A migrated, empty store on SQLite and on a real PostgreSQL."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'gateway.db'}"
    else:
        url = new_pg_database(request.getfixturevalue("postgres_url"), "t_" + uuid.uuid4().hex[:12])
    s = Store(url)
    s.migrate()
    return s


@dataclass
class Live:
    url: str
    server: object
    thread: object
    app: object

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_fake(name: str = "fake", kind: str = "openai") -> Live:
    app = make_app(name, kind)
    url, server, thread = serve_in_thread(app)
    return Live(url, server, thread, app)


def start_gateway(backends: list[str], store: Store, **kw) -> Live:
    kw.setdefault("health_interval", 0.2)
    kw.setdefault("admin_key", ADMIN)
    limiter = kw.pop("limiter", None) or MemoryLimiter()
    ledger = kw.pop("ledger", None)
    cfg = GatewayConfig(backends=tuple(backends), **kw)
    app = build_gateway_app(cfg, store, SECRET, limiter, ledger)
    url, server, thread = serve_in_thread(app)
    return Live(url, server, thread, app)


def wait_until(cond, timeout: float = 90.0, what: str = "condition") -> None:
    """Poll `cond` until true; the timeout only ends a test that would hang (a loaded 2-core
    machine has been seen to take over 20 s for a state the test then reaches)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_warm(gw: Live, n_backends: int = 1) -> None:
    """Until the gateway has warmed `n_backends` backends (each warm-up runs once a backend is up)."""
    wait_until(lambda: gw.app.state.monitor.warmups >= n_backends, what="warm-up")


def start_fake_process(name: str, port: int | None = None) -> tuple[str, subprocess.Popen]:
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.gateway.fake_backend", "--port", str(port), "--name", name])
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, what=f"fake backend {name}")
    return url, proc
