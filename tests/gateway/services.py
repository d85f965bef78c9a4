"""Real Redis and PostgreSQL servers for the gateway tests, started from the
Debian packages (`make test` installs them) on loopback ports in temp folders."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

from tests.server.conftest import free_port

MISSING = "{} is not installed: run `make test-services` (apt-get install redis-server postgresql)"


@dataclass
class Service:
    url: str
    proc: subprocess.Popen
    folder: str

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_redis() -> Service:
    exe = shutil.which("redis-server")
    assert exe, MISSING.format("redis-server")
    import redis

    port, folder = free_port(), tempfile.mkdtemp(prefix="hp-redis-")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return Service(url, proc, folder)
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("redis-server did not start")


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    assert found, MISSING.format(f"PostgreSQL ({name})")
    return found[-1]


def start_postgres() -> Service:
    """A throwaway cluster (trust auth on loopback). PostgreSQL refuses to run as
    root, so under root it runs as Debian's `postgres` user."""
    import psycopg

    port, folder = free_port(), tempfile.mkdtemp(prefix="hp-pg-")
    data = os.path.join(folder, "data")
    prefix: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    subprocess.run(prefix + [_pg_bin("initdb"), "-D", data, "-A", "trust", "-U", "postgres", "--no-sync"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    proc = subprocess.Popen(prefix + [_pg_bin("postgres"), "-D", data, "-p", str(port), "-k", folder,
                                      "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    for _ in range(400):
        try:
            psycopg.connect(url, connect_timeout=2).close()
            return Service(url, proc, folder)
        except psycopg.OperationalError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("postgres did not start")


def new_pg_database(server_url: str, name: str) -> str:
    import psycopg

    with psycopg.connect(server_url, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    return server_url.rsplit("/", 1)[0] + "/" + name
