"""The disk tier: one file per KV block, written behind and read ahead in threads.

Layout: DIR/<model identity>/<block hash>.kvb. The identity (`model_identity`) digests
the model's weights fingerprint, shapes, compute and KV dtypes, block size, matmul mode
and this format's version, so another model's (or another configuration's) files are
never even looked at. A file is a header (magic, identity, block hash, payload length,
and a MAC: HMAC-SHA256 of all of these and the payload, keyed by DIR's secret) and the
block's bytes (the layout of model/kv_offload.py). At start-up the directory is indexed
from its file names and sizes alone (oldest first, by mtime); data is checked when a
block is read: a wrong header, a short file or a MAC that does not match is a miss (the
file is deleted, `bad_files` counts it), never wrong KV.

The files are what later prompts are answered from, so the directory is guarded like a
key: DIR is created 0700 and the tier refuses (ConfigError, at start) a DIR that others
may write or that another user owns, or a symlink to one; its secret (DIR/.hotprefix-kv-key,
32 random bytes, 0600, made at first use and never inside a block file) keys every MAC,
so a block written by anyone without it is a miss. `insecure` (--kv-disk-insecure) skips
the directory checks, with a warning.

Writes go through a temporary file and a rename, so a process killed mid-write leaves
no partial block under a real name (stale temporaries are removed at start-up). The
tier keeps under its byte budget by deleting its least recently used files. A full
disk, a read-only or missing directory: logged once, the tier stops writing (or is
off), and no request fails.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import stat
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hotprefix.config import ConfigError
from hotprefix.core.hashing import BlockHash
from hotprefix.sizing import DISK_HEADER_BYTES

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
MAGIC = b"HPKVBLK2"
_FIELDS = struct.Struct("<8s32s32sQ")  # magic, identity, block hash, payload length
_HEADER = struct.Struct("<8s32s32sQ32s")  # the fields, then HMAC-SHA256 of the fields and the payload
assert _HEADER.size == DISK_HEADER_BYTES  # hotprefix size counts files with it
KEY_FILE = ".hotprefix-kv-key"
KEY_BYTES = 32
SUFFIX = ".kvb"
MAX_PENDING_WRITE_BYTES = 256 << 20  # blocks waiting for the writer; more are dropped, not queued


def weights_fingerprint(source: str) -> str:
    """A cheap fingerprint of a model's weight files: each file's name, size, and the
    SHA-256 of its first and last 4 MiB (GGUF headers and tensor data; safetensors
    headers and tensor data), without reading whole multi-GB files."""
    p = Path(source)
    files = [p] if p.is_file() else sorted(f for f in p.glob("*") if f.suffix in (".safetensors", ".bin", ".gguf"))
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(4 << 20))
            fh.seek(max(0, size - (4 << 20)))
            h.update(fh.read(4 << 20))
    return h.hexdigest()


def _refuse(path: Path, why: str) -> None:
    raise ConfigError(f"--kv-disk-dir {path}: {why}; use a private directory (mode 0700, yours), or "
                      "--kv-disk-insecure to use it anyway")


def check_private_dir(root: Path, insecure: bool = False) -> None:
    """Make sure `root` is a directory no one else may write: create it 0700 when it does
    not exist; refuse one (or a symlink to one) that another user owns or that group or
    others may write. Raises ConfigError (unless `insecure`, which logs instead) and
    OSError when it cannot be created."""
    if not root.exists() and not root.is_symlink():
        root.mkdir(parents=True, mode=0o700)
        root.chmod(0o700)  # (mkdir's mode is masked by the umask)
    problems = []
    if root.is_symlink() and root.lstat().st_uid != os.geteuid():
        problems.append("it is a symlink another user owns")
    st = root.stat()  # the target, for a symlink
    if not stat.S_ISDIR(st.st_mode):
        problems.append("it is not a directory")
    if st.st_uid != os.geteuid():
        problems.append(f"it belongs to user {st.st_uid}, not to this process's user {os.geteuid()}")
    if st.st_mode & 0o022:
        problems.append(f"group or others may write to it (mode {st.st_mode & 0o777:o})")
    if not problems:
        return
    if not insecure:
        _refuse(root, "; ".join(problems))
    log.warning("KV disk tier %s is not private (%s): used anyway (--kv-disk-insecure)", root, "; ".join(problems))


def directory_key(root: Path, insecure: bool = False) -> bytes:
    """The secret that keys the MACs of `root`'s blocks: read, or made at first use
    (written under a temporary name and linked into place, so that two processes
    starting together agree on one). Raises ConfigError for a key file that is not a
    private regular file of this user, OSError when it cannot be made."""
    path = root / KEY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        tmp = root / f".key.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        finally:
            tmp.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            _refuse(path, "its key file is a symlink")
        raise
    try:
        st = os.fstat(fd)
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode) or len(key) != KEY_BYTES:
        _refuse(path, "its key file is not a 32-byte regular file")
    if (st.st_uid != os.geteuid() or st.st_mode & 0o077) and not insecure:
        _refuse(path, f"its key file may be read or written by others (mode {st.st_mode & 0o777:o}, "
                      f"user {st.st_uid})")
    return key


def block_mac(key: bytes, fields: bytes, payload: memoryview) -> bytes:
    """HMAC-SHA256 of a block file's header fields and payload (0.5 ms a 737 KB block)."""
    m = hmac.new(key, fields, "sha256")
    m.update(payload)
    return m.digest()


def model_identity(**facts: Any) -> bytes:
    """32 bytes naming everything that makes a block's bytes what they are."""
    return hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **facts}, sort_keys=True).encode()).digest()


@dataclass
class DiskStats:
    """Totals since start (read by /metrics)."""

    written_blocks: int = 0
    written_bytes: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    bad_files: int = 0
    dropped_writes: int = 0
    write_errors: int = 0


class DiskStore:
    """The disk tier for one engine. `has`, `load` and `finished` are called by the
    engine thread (core/kv_tiers.DiskTier); `persist` queues blocks for the writer
    thread; reads land in the host arena's slots (`slot_bytes(slot)`)."""

    def __init__(self, root: str, identity: bytes, capacity_bytes: int, block_bytes: int,
                 slot_bytes: Any, insecure: bool = False) -> None:
        """Raises ConfigError for a directory (or key file) others may write (see the
        module's docstring)."""
        self.identity = identity
        self.root, self.insecure = Path(root), insecure
        self.key = b""
        self.file_bytes = _HEADER.size + block_bytes
        self.block_bytes = block_bytes
        self.max_files = capacity_bytes // self.file_bytes
        self.slot_bytes = slot_bytes
        self.dir = Path(root) / identity.hex()[:32]
        self.stats = DiskStats()
        self._lock = threading.Lock()
        self.index: OrderedDict[BlockHash, None] = OrderedDict()  # least recently used first
        self.writable = self._open()
        self._writes: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._reads: queue.Queue = queue.Queue()
        self._done: list[tuple[BlockHash, bool]] = []
        self._changes: list[tuple[BlockHash, bool]] | None = None  # see record_changes
        self._read_done = threading.Event()
        self._threads = [threading.Thread(target=self._write_loop, name="hotprefix-kv-writer", daemon=True),
                         threading.Thread(target=self._read_loop, name="hotprefix-kv-reader", daemon=True)]
        for t in self._threads:
            t.start()

    # -- start-up --------------------------------------------------------------
    def _open(self) -> bool:
        """Check (ConfigError), create and index the directory; False (with a warning) when
        it cannot be written."""
        try:
            check_private_dir(self.root, self.insecure)
            self.key = directory_key(self.root, self.insecure)
            self.dir.mkdir(mode=0o700, exist_ok=True)
            found = []
            for e in os.scandir(self.dir):
                if ".tmp" in e.name:
                    os.unlink(e.path)  # a write that never finished
                elif e.name.endswith(SUFFIX) and len(e.name) == 64 + len(SUFFIX):
                    st = e.stat()
                    if st.st_size == self.file_bytes:
                        found.append((st.st_mtime_ns, e.name))
                    else:  # another layout (a format change) or a short file
                        os.unlink(e.path)
            for _, name in sorted(found):
                self.index[BlockHash(bytes.fromhex(name[:64]))] = None
            probe = self.dir / f".probe.tmp.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            log.info("KV disk tier %s: %d blocks indexed (budget %d blocks)", self.dir, len(self.index),
                     self.max_files)
            return True
        except OSError as e:
            if not self.key:  # no key, no block can be checked: none is read either
                self.index.clear()
            log.warning("KV disk tier %s cannot be written (%s): %s", self.dir, e.strerror or e,
                        "reading what is there, writing nothing" if self.key else "off")
            return False

    # -- the engine thread's side -----------------------------------------------
    def has(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self.index

    def load(self, block_hash: BlockHash, slot: int) -> None:
        self._reads.put((block_hash, slot))

    def finished(self) -> list[tuple[BlockHash, bool]]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a read finishes (or `timeout` seconds pass)."""
        self._read_done.wait(timeout)
        self._read_done.clear()

    @property
    def num_blocks(self) -> int:
        return len(self.index)

    def record_changes(self) -> None:
        """Record each block the index gains (True) or loses (False) from now on, these gained."""
        with self._lock:
            self._changes = [(h, True) for h in self.index]

    def take_changes(self) -> list[tuple[BlockHash, bool]]:
        with self._lock:
            out, self._changes = self._changes or [], None if self._changes is None else []
        return out

    def _changed(self, h: BlockHash, present: bool) -> None:
        if self._changes is not None:  # (under the lock)
            self._changes.append((h, present))

    def persist(self, blocks: list[tuple[BlockHash, Any]]) -> None:
        """Queue (hash, block bytes) for writing; blocks already on disk are skipped,
        and ones over the pending budget are dropped (counted), never waited for."""
        if not self.writable or self.max_files == 0:
            return
        for h, data in blocks:
            if self.has(h):
                continue
            with self._lock:  # the writer thread takes it down
                full = self._pending_bytes + self.block_bytes > MAX_PENDING_WRITE_BYTES
                if not full:
                    self._pending_bytes += self.block_bytes
            if full:
                self.stats.dropped_writes += 1
                continue
            self._writes.put((h, data))

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued writes (up to `timeout` seconds), then stop the threads."""
        self._writes.put(None)
        self._reads.put(None)
        for t in self._threads:
            t.join(timeout)

    # -- the writer thread -----------------------------------------------------
    def flush(self) -> None:
        """Block until every queued write is done (or dropped)."""
        self._writes.join()

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            h, data = item
            try:
                if self.writable and not self.has(h):
                    self._write(h, data)
            except OSError as e:
                self.stats.write_errors += 1
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
                    self.writable = False
                    log.warning("KV disk tier %s: %s; no more blocks are written", self.dir, e.strerror or e)
                else:
                    log.warning("KV disk tier %s: a block was not written: %s", self.dir, e)
            finally:
                with self._lock:
                    self._pending_bytes -= self.block_bytes
                self._writes.task_done()
        self._writes.task_done()

    def _write(self, h: BlockHash, data: Any) -> None:
        payload = memoryview(data).cast("B")
        fields = _FIELDS.pack(MAGIC, self.identity, h, len(payload))
        header = fields + block_mac(self.key, fields, payload)
        final = self.dir / (h.hex() + SUFFIX)
        tmp = self.dir / f".{h.hex()}.tmp.{os.getpid()}"
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                f.write(header)
                f.write(payload)
            self._make_room()
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self.index[h] = None
            self._changed(h, True)
        self.stats.written_blocks += 1
        self.stats.written_bytes += self.file_bytes

    def _make_room(self) -> None:
        while True:
            with self._lock:
                if len(self.index) < self.max_files or not self.index:
                    return
                old, _ = self.index.popitem(last=False)
                self._changed(old, False)
            (self.dir / (old.hex() + SUFFIX)).unlink(missing_ok=True)

    # -- the reader thread -------------------------------------------------------
    def _read_loop(self) -> None:
        while (item := self._reads.get()) is not None:
            h, slot = item
            ok = False
            try:
                ok = self._read(h, slot)
            except OSError as e:
                log.warning("KV disk tier: cannot read block %s: %s", h.hex()[:12], e)
            if not ok:
                self._forget(h)
            with self._lock:
                self._done.append((h, ok))
            self._read_done.set()

    def _read(self, h: BlockHash, slot: int) -> bool:
        path = self.dir / (h.hex() + SUFFIX)
        with path.open("rb") as f:
            raw = f.read(self.file_bytes + 1)
        if len(raw) != self.file_bytes:
            return self._bad(h, "its size is wrong")
        magic, ident, fh, n, mac = _HEADER.unpack_from(raw)
        payload = memoryview(raw)[_HEADER.size:]
        if magic != MAGIC or ident != self.identity or fh != h or n != self.block_bytes:
            return self._bad(h, "its header names another block or model")
        if not hmac.compare_digest(block_mac(self.key, raw[:_FIELDS.size], payload), mac):
            return self._bad(h, "its MAC does not match (damaged, or not written with this directory's key)")
        self.slot_bytes(slot)[:] = np.frombuffer(payload, dtype=np.uint8)
        os.utime(path)  # recently used: the last to be deleted, here and after a restart
        with self._lock:
            if h in self.index:
                self.index.move_to_end(h)
        self.stats.read_blocks += 1
        self.stats.read_bytes += self.file_bytes
        return True

    def _bad(self, h: BlockHash, why: str) -> bool:
        self.stats.bad_files += 1
        log.warning("KV disk tier: block %s ignored and deleted: %s", h.hex()[:12], why)
        (self.dir / (h.hex() + SUFFIX)).unlink(missing_ok=True)
        return False

    def _forget(self, h: BlockHash) -> None:
        with self._lock:
            if self.index.pop(h, False) is None:  # (it was indexed: the index's values are None)
                self._changed(h, False)
