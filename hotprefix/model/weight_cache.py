"""int8 mode's regrouped weights, made once per model file and kept on disk.

Regrouping a GGUF file's blocks for the int8 products (csrc/repack.c) reads every weight
once and writes as much again: about a second for a 1B Q4_K_M file, several for an 8B
one. The result is written to a file under $HOTPREFIX_CACHE/regrouped, named by the
model file's identity (resolved path, size, mtime) and the kernel sources' digest (the
layouts are defined there), and mapped on later starts: nothing is read before a product
needs it, and the pages are the page cache's, shared by every server of that file.

Format: b"HPRG" | version u32 | index length u64 | index (JSON: name -> [offset, bytes,
qtype, n, k], a mixture's experts with their count after) | each weight at a 4096-aligned
offset (a mixture's experts one after another inside it). A file that does not parse or whose
index differs from the weights asked for is rebuilt. It is written under a temporary
name (its space allocated first), synced and renamed into place, so a process killed
mid-write leaves nothing that reads as complete; the next start removes such leftovers.
The start that writes it serves from the temporary file's pages at once: the sync to disk
and the rename run on a thread of their own (`settle` waits for them; the interpreter's
exit does too), since writing an 8B model's ~5 GB back to disk takes seconds the weights
do not need (the page cache holds them either way). The directory is private (0700): what
is in it becomes weights, as the built kernels beside it become code.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import numpy as np
import torch

from hotprefix.config import cache_root
from hotprefix.model.kernels.build import source_digest
from hotprefix.model.kernels.weights import ExpertBlocks, PackedWeight

log = logging.getLogger(__name__)

MAGIC, VERSION, ALIGN = b"HPRG", 1, 4096
_HEAD = struct.Struct("<4sIQ")
_syncing: dict[Path, threading.Thread] = {}  # files written by this process, being synced and renamed into place


def _entry(w: PackedWeight | ExpertBlocks, off: int, size: int) -> list[int]:
    """A weight's index entry: [offset, bytes, qtype, n, k], and a mixture's experts' count."""
    return [off, size, w.qtype, w.n, w.k] + ([w.experts] if isinstance(w, ExpertBlocks) else [])


def _spec(packed: dict[str, PackedWeight | ExpertBlocks], names: list[str], lib: ctypes.CDLL
          ) -> dict[str, list[int]]:
    """name -> [offset, bytes, qtype, n, k(, experts)] of the file that holds these weights regrouped."""
    sizes = {n: packed[n].regrouped_bytes(lib) for n in names}
    head = len(json.dumps({n: _entry(packed[n], 0, s) for n, s in sizes.items()}))
    off = -(-(_HEAD.size + head + 64 * len(names)) // ALIGN) * ALIGN  # room for the offsets' digits
    spec = {}
    for n in names:
        spec[n] = _entry(packed[n], off, sizes[n])
        off = -(-(off + sizes[n]) // ALIGN) * ALIGN
    return spec


def _mapped(data: np.ndarray, entry: list[int]) -> PackedWeight | ExpertBlocks:
    """The regrouped weight an index entry names, a view of the map."""
    off, size, qtype, rows, k, *experts = entry
    raw = torch.from_numpy(data[off:off + size])
    if experts:
        return ExpertBlocks(qtype, raw.view(experts[0], -1), experts[0], rows, k, int8=True)
    return PackedWeight(qtype, raw, rows, k, int8=True)


def cache_path(source: Path, spec: dict[str, list[int]], part: str = "") -> Path:
    """Where the regrouped weights of `source` with this index live (`part`: a
    tensor-parallel rank's, whose index may equal another rank's)."""
    src = source.resolve()
    st = src.stat()
    who = hashlib.sha256(str(src).encode()).hexdigest()[:12]
    what = hashlib.sha256(f"{VERSION}|{st.st_size}|{st.st_mtime_ns}|{source_digest()}|"
                          f"{json.dumps(spec, sort_keys=True)}{part and '|' + part}".encode()).hexdigest()[:16]
    return cache_root() / "regrouped" / f"{who}-{what}.bin"


def _read(path: Path, spec: dict[str, list[int]]) -> dict[str, PackedWeight] | None:
    """The weights of a complete cache file matching `spec` (views of its private map), or None."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="c")
    except (OSError, ValueError):
        return None
    try:
        magic, version, n = _HEAD.unpack_from(data, 0)
        index = json.loads(bytes(data[_HEAD.size:_HEAD.size + n])) if magic == MAGIC and version == VERSION else None
    except (struct.error, ValueError, UnicodeDecodeError):
        index = None
    if index != spec or max(off + size for off, size, *_ in spec.values()) > len(data):
        return None
    return {name: _mapped(data, entry) for name, entry in spec.items()}


def _write(path: Path, packed: dict[str, PackedWeight], spec: dict[str, list[int]], lib: ctypes.CDLL) -> Path:
    """Regroup every weight of `spec` straight into a new temporary file beside `path`
    (its blocks allocated first, so a full disk fails here, not at write-back) and return
    its name; nothing is synced yet (`_finish`). Raises OSError (disk full, read-only
    cache); a failed write leaves no file."""
    total = max(off + size for off, size, *_ in spec.values())
    index = json.dumps(spec).encode()
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb+") as f:
            f.truncate(total)
            try:
                os.posix_fallocate(f.fileno(), 0, total)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise  # (a file system without it: the size check before is all there is)
        out = np.memmap(tmp, dtype=np.uint8, mode="r+", shape=(total,))  # closed when the last view goes
        head = _HEAD.pack(MAGIC, VERSION, len(index)) + index
        if len(head) > min(off for off, *_ in spec.values()):
            raise RuntimeError("the regrouped cache's index outgrew its room")
        out[:len(head)] = np.frombuffer(head, dtype=np.uint8)
        for name, (off, size, *_) in spec.items():
            packed[name].regrouped(lib, out=torch.from_numpy(out[off:off + size]))
        del out
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _finish(tmp: Path, path: Path) -> None:
    """Sync a written temporary file to disk and rename it into place (its pages may be in
    use: a rename leaves maps alone); on an OSError, warn and remove it."""
    try:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        log.warning("int8 weights: could not keep %s (%s); the next start regroups again", path, e)
        tmp.unlink(missing_ok=True)


def settle() -> None:
    """Wait until the cache files written at this start are synced and in place."""
    while _syncing:
        _syncing.pop(next(iter(_syncing))).join()


def _tidy(folder: Path, keep: Path) -> None:
    """Remove leftovers: temporaries of processes that are gone, and older caches of the
    same model path (an updated file, or other kernel sources)."""
    for f in folder.iterdir():
        name = f.name
        if ".tmp." in name:
            pid = name.rsplit(".", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                f.unlink(missing_ok=True)
        elif name.startswith(keep.name.split("-")[0] + "-") and f != keep:
            f.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def regrouped_weights(source: Path, packed: dict[str, PackedWeight], names: list[str],
                      lib: ctypes.CDLL, part: str = "") -> dict[str, PackedWeight]:
    """The int8 form of packed[name] for each name: mapped from the cache, built into it
    when missing or stale. Where the cache cannot be written (no space, read-only), they
    are regrouped in memory with a warning. Raises RuntimeError for a weight the kernel
    cannot regroup."""
    if not names:
        return {}
    spec = _spec(packed, names, lib)
    path = cache_path(source, spec, part)
    t0 = time.perf_counter()
    if path in _syncing:  # this process wrote it: its temporary name is the one a rewrite would take
        _syncing.pop(path).join()
    got = _read(path, spec)
    if got is not None:
        log.info("int8 weights: mapped %s (%.2f GB, regrouped at an earlier start) in %.2fs", path,
                 path.stat().st_size / 1e9, time.perf_counter() - t0)
        return got
    total = max(off + size for off, size, *_ in spec.values())
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.parent.chmod(0o700)
        _tidy(path.parent, path)
        free = shutil.disk_usage(path.parent).free
        if free < total + (256 << 20):
            raise OSError(f"{total / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free")
        tmp = _write(path, packed, spec, lib)
    except OSError as e:
        log.warning("int8 weights: cannot keep them in %s (%s): regrouped in memory for this start",
                    path.parent, e)
        return {n: packed[n].regrouped(lib) for n in names}
    got = _read(tmp, spec)
    if got is None:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"the regrouped weights just written to {tmp} do not read back")
    sync = threading.Thread(target=_finish, args=(tmp, path), name="hotprefix-weight-sync")
    sync.start()
    _syncing[path] = sync
    log.info("int8 weights: regrouped %d weights (%.2f GB) into %s in %.2fs (synced to disk in the background); "
             "later starts map it", len(names), total / 1e9, path, time.perf_counter() - t0)
    return got
