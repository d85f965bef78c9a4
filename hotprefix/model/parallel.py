"""Tensor parallelism: one model over several ranks, and what they say to each other.

A rank's place (`Place`: rank, size) decides which part of each weight it keeps
(`ShardPlan`, from its family's `Sharding`: Megatron's column, row and vocabulary splits)
and the shape it runs (`shard_arch`: its heads, its MLP columns). `Parallel` is that place
with its process groups, made complete by `Parallel.single()` (one device: every collective
is the identity and nothing is sent, so `-tp 1` runs exactly as without this module) or
`Parallel.join(...)` (torch.distributed: gloo on the CPU, NCCL on CUDA). Rank 0 schedules
and samples; every rank runs each step's layers (docs/parallel.md).

Raises: ConfigError for a shape that does not split, ModelLoadError for a weight that does
not, PeerLostError when a peer is gone (its collective fails, or it cannot be reached at start).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

import torch

from hotprefix.config import ConfigError
from hotprefix.errors import PeerLostError
from hotprefix.model.arch import ModelArch, ModelLoadError
from hotprefix.model.families import FAMILIES, Sharding
from hotprefix.sizing import split_refusal, vocab_rows

__all__ = ["ALONE", "SINGLE", "Parallel", "Place", "ShardKind", "ShardPlan", "shard_arch", "vocab_rows"]

STEP_TIMEOUT = datetime.timedelta(minutes=10)  # a collective inside a step: a peer that long silent is lost
IDLE_TIMEOUT = datetime.timedelta(days=3650)  # waiting for rank 0's next step: as long as the server idles
JOIN_POLL = datetime.timedelta(seconds=1)  # rank 0 asks whether a spawned rank exited this often while it waits
JOINED = "hotprefix/joined/"  # + rank: the store key each other rank sets when it has come


@dataclass(frozen=True)
class Place:
    """rank of size ranks (0 of 1: one device)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} of {self.size}: a rank is 0 .. size - 1")


ALONE = Place()


class ShardKind(Enum):
    WHOLE = "whole"
    COLUMN = "column"  # a rank's output rows (dim 0)
    ROW = "row"  # a rank's input columns (dim 1); outputs summed over ranks
    VOCAB = "vocab"  # a rank's vocabulary rows (dim 0), padded to ceil(V / size)


def shard_arch(arch: ModelArch, size: int) -> ModelArch:
    """The shape one of `size` ranks runs: its query and KV heads (GQA groups whole), its MLP
    columns. Raises ConfigError, naming the numbers, for a model that does not split."""
    if size == 1:
        return arch
    if FAMILIES[arch.family].sharding is None:
        raise ConfigError(f"--tensor-parallel-size {size}: the {arch.family} family runs on one device only "
                          "(no sharding declared)")
    if (why := split_refusal(size, arch.num_heads, arch.num_kv_heads, arch.intermediate_size)) is not None:
        raise ConfigError(why)
    return replace(arch, num_heads=arch.num_heads // size, num_kv_heads=arch.num_kv_heads // size,
                   intermediate_size=arch.intermediate_size // size)


@dataclass(frozen=True)
class ShardPlan:
    """Which part of each weight (HF name) one rank keeps."""

    sharding: Sharding
    place: Place

    @classmethod
    def of(cls, arch: ModelArch, place: Place) -> ShardPlan | None:
        """The plan of `place` for arch's family (None on one device). Raises ConfigError as shard_arch."""
        if place.size == 1:
            return None
        shard_arch(arch, place.size)
        return cls(FAMILIES[arch.family].sharding, place)

    def kind(self, name: str) -> ShardKind:
        parts = name.rsplit(".", 2)
        module = parts[-2] if len(parts) > 1 else ""
        s = self.sharding
        return (ShardKind.COLUMN if module in s.column else ShardKind.ROW if module in s.row
                else ShardKind.VOCAB if module in s.vocab else ShardKind.WHOLE)

    def part(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the rank's part of weight `name` of `shape`, or None for a
        whole one. Raises ModelLoadError for a dimension that does not split evenly or a
        row-parallel bias (it would be added once per rank)."""
        kind, rank, size = self.kind(name), self.place.rank, self.place.size
        if kind is ShardKind.WHOLE:
            return None
        if kind is ShardKind.VOCAB:
            rows = vocab_rows(shape[0], size)
            return 0, min(shape[0], rank * rows), min(shape[0], (rank + 1) * rows)
        dim = 0 if kind is ShardKind.COLUMN else 1
        if len(shape) <= dim:
            raise ModelLoadError(f"{name}: a row-parallel bias is not supported (tensor parallelism)")
        if shape[dim] % size:
            raise ModelLoadError(f"{name}: dimension {dim} ({shape[dim]}) does not split over {size} ranks")
        n = shape[dim] // size
        return dim, rank * n, (rank + 1) * n

    def cut(self, name: str, shape: tuple[int, ...], read: Callable[[tuple[slice, ...] | None], torch.Tensor]
            ) -> torch.Tensor:
        """The rank's part of weight `name`: read(index) gives the tensor's [index] (None:
        the whole), a new tensor owning only those bytes; vocabulary rows padded with zeros."""
        where = self.part(name, shape)
        if where is None:
            return read(None)
        dim, start, stop = where
        index = (slice(start, stop),) if dim == 0 else (slice(None), slice(start, stop))
        t = read(index).clone()  # its own storage: the whole tensor is not kept alive
        if self.kind(name) is ShardKind.VOCAB and (pad := vocab_rows(shape[0], self.place.size) - t.shape[0]):
            t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
        return t

    def cut_tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """cut() of a tensor already in memory (meta ones stay whole: blocks serve them)."""
        return t if t.is_meta else self.cut(name, tuple(t.shape), lambda i: t if i is None else t[i])


def _meet(place: Place, address: str, port: int, timeout: datetime.timedelta,
          watch: Callable[[], str | None]) -> Any:
    """The group's store at address:port once every rank has come: rank 0 hosts it (unless
    torchrun's agent does, as torch's own tcp:// rendezvous decides) and waits for each
    other rank's mark, asking `watch` between waits. Raises PeerLostError when watch says
    why a peer will not come, DistStoreError (or RuntimeError) when `timeout` passes."""
    from torch.distributed import DistStoreError, TCPStore

    host = place.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = TCPStore(address, port, place.size, is_master=host, timeout=timeout, wait_for_workers=False,
                     multi_tenant=True)
    if place.rank:
        store.set(f"{JOINED}{place.rank}", "1")
        return store
    marks, waited = [f"{JOINED}{r}" for r in range(1, place.size)], datetime.timedelta()
    while True:
        try:
            store.wait(marks, JOIN_POLL)
            return store
        except DistStoreError:
            waited += JOIN_POLL
            if (why := watch()) is not None:
                raise PeerLostError(f"tensor parallel: {why} before it joined rank 0 at {address}:{port}") from None
            if waited >= timeout:
                raise


def _lost(what: str, e: BaseException) -> PeerLostError:
    return PeerLostError(f"tensor parallel: a peer rank is gone ({what}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})")


@dataclass(frozen=True)
class Parallel:
    """One rank of a tensor-parallel group (size 1: alone, and every method is the identity).
    `group`: the step's collectives (STEP_TIMEOUT); `control`: rank 0's messages (IDLE_TIMEOUT)."""

    place: Place = ALONE
    group: Any = None
    control: Any = None

    @classmethod
    def single(cls) -> Parallel:
        return cls()

    @classmethod
    def join(cls, place: Place, address: str, port: int, device: torch.device,
             timeout: datetime.timedelta = datetime.timedelta(seconds=120),
             watch: Callable[[], str | None] = lambda: None) -> Parallel:
        """Join the group at address:port (rank 0 hosts it): gloo on the CPU, NCCL on CUDA.
        Rank 0 asks `watch` each JOIN_POLL while it waits: why a peer will not come (a spawned
        rank that exited), or None. Raises PeerLostError, one line, when watch says why, or
        when the peers do not all come within `timeout`."""
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            store = _meet(place, address, port, timeout, watch)
            dist.init_process_group(backend, store=store, rank=place.rank, world_size=place.size, timeout=timeout)
            control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
            group = dist.new_group(backend=backend, timeout=STEP_TIMEOUT)
        except PeerLostError:
            raise
        except Exception as e:  # torch raises several types (DistStoreError, RuntimeError) for an absent peer
            why = watch()
            raise PeerLostError(f"tensor parallel: rank {place.rank} of {place.size} could not reach its peers at "
                                f"{address}:{port} within {timeout.total_seconds():.0f}s ({type(e).__name__})"
                                + (f"; {why}" if why else "")) from None
        return cls(place, group, control)

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def size(self) -> int:
        return self.place.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (size 1: x as it is). Raises PeerLostError."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        try:
            dist.all_reduce(x, group=self.group)
        except Exception as e:
            raise _lost("all-reduce", e) from None
        return x

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """Logits [N, vocab] on rank 0 from each rank's [N, rows] (size 1: local as it is);
        other ranks get their own part back. Raises PeerLostError."""
        out = self.gather(local, -1, self.group, "logits gather")
        return out[:, :vocab] if self.size > 1 and self.rank == 0 else out

    def gather(self, local: torch.Tensor, dim: int, group: Any = None, what: str = "gather") -> torch.Tensor:
        """Rank 0: every rank's `local` joined along dim, in rank order (size 1: local);
        other ranks get local back. `group`: the control group's gloo unless given (host
        tensors). Raises PeerLostError."""
        if self.size == 1:
            return local
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(local.contiguous(), parts, dst=0, group=self.control if group is None else group)
        except Exception as e:
            raise _lost(what, e) from None
        return torch.cat(parts, dim=dim) if parts is not None else local

    def scatter(self, whole: torch.Tensor | None, like: torch.Tensor, dim: int) -> torch.Tensor:
        """Rank r's part (the r-th of `size` along dim) of rank 0's host tensor `whole`, in
        a new tensor shaped like `like` (size 1: whole). Raises PeerLostError."""
        if self.size == 1:
            return whole
        import torch.distributed as dist

        out = torch.empty_like(like)
        parts = [p.contiguous() for p in whole.chunk(self.size, dim)] if self.rank == 0 else None
        try:
            dist.scatter(out, parts, src=0, group=self.control)
        except Exception as e:
            raise _lost("scatter", e) from None
        return out

    def min_int(self, n: int) -> int:
        """The least n over the ranks (the pool's blocks). Raises PeerLostError."""
        if self.size == 1:
            return n
        import torch.distributed as dist

        t = torch.tensor([n], dtype=torch.long)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        except Exception as e:
            raise _lost("start-up", e) from None
        return int(t.item())

    def send(self, message: object) -> None:
        """Rank 0: the message (plain data, pickled) to every other rank; the others, which
        follow rank 0's messages, send nothing. Raises PeerLostError."""
        if self.size > 1 and self.rank == 0:
            self._broadcast(message)

    def receive(self) -> object:
        """Another rank: rank 0's next message (waits as long as it takes). Raises PeerLostError."""
        return self._broadcast(None)

    def _broadcast(self, message: object) -> object:
        import torch.distributed as dist

        box = [message]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except Exception as e:
            raise _lost("step message", e) from None
        return box[0]

    def close(self) -> None:
        """Leave the group (nothing to do alone)."""
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()



SINGLE = Parallel()  # one device
