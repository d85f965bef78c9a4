"""The tensor-parallel ranks of one engine (`--tensor-parallel-size N`; docs/parallel.md).

Rank 0 is the engine's own process: it schedules, samples and sends each step to the
others (model/lockstep.py). The others are spawned here (torch.multiprocessing's spawn,
meeting on a free loopback port) or started by torchrun (its RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT: `hotprefix serve` on a rank other than 0 runs `rank_main`).
Each loads only its part of the weights (model/parallel.ShardPlan), builds its ModelRunner
and follows rank 0 until it stops or is gone.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hotprefix.config import ConfigError, EngineConfig, LoadFormat, ModelConfig
from hotprefix.errors import PeerLostError
from hotprefix.grammar import GrammarCompiler
from hotprefix.model.build import resolve_device
from hotprefix.model.loader import LoadedModel, load_dummy, load_model
from hotprefix.model.parallel import ALONE, SINGLE, Parallel, Place
from hotprefix.model.runner import ModelRunner

log = logging.getLogger(__name__)
JOIN_SECONDS = 10  # a spawned rank's exit is waited for this long after Stop, then it is killed


@dataclass(frozen=True)
class Launch:
    """Where the ranks meet (address:port, rank 0 hosting) and whether rank 0 spawns the
    others (else torchrun started them)."""

    place: Place = ALONE
    address: str = "127.0.0.1"
    port: int = 0
    spawn: bool = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_of(size: int, env: Mapping[str, str] = os.environ) -> Launch:
    """This process's launch: torchrun's when its variables are set, else rank 0 spawning
    the others on loopback (size 1: alone). Raises ConfigError when torchrun's world size
    is not `size`."""
    if size == 1:
        return Launch()
    if "RANK" in env and "WORLD_SIZE" in env:
        if int(env["WORLD_SIZE"]) != size:
            raise ConfigError(f"--tensor-parallel-size {size}, but torchrun started {env['WORLD_SIZE']} ranks "
                              "(WORLD_SIZE)")
        return Launch(Place(int(env["RANK"]), size), env.get("MASTER_ADDR", "127.0.0.1"),
                      int(env.get("MASTER_PORT", "29500")))
    return Launch(Place(0, size), "127.0.0.1", _free_port(), spawn=True)


def load_rank(mc: ModelConfig, place: Place) -> LoadedModel:
    """The model as `place`'s rank loads it: its part of each weight. Raises ModelLoadError,
    or ConfigError for a model that does not split over place.size (before anything is read)."""
    if mc.load_format is LoadFormat.DUMMY:
        return load_dummy(mc.model, mc.tokenizer)
    return load_model(mc.model, mc.revision, mc.tokenizer, mc.download_dir, place)


def _join(launch: Launch, mc: ModelConfig, watch: Callable[[], str | None] = lambda: None) -> Parallel:
    device = resolve_device(mc.device)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(launch.place.rank % torch.cuda.device_count())  # rank r on cuda:r
    return Parallel.join(launch.place, launch.address, launch.port, device, watch=watch)


class Ranks:
    """Rank 0's side of the group: the ranks it spawned and its Parallel (size 1: none, and
    SINGLE). Raises PeerLostError when the peers do not come."""

    def __init__(self, config: EngineConfig, launch: Launch) -> None:
        self.procs: list = []
        self.parallel = SINGLE
        if launch.place.size == 1:
            return
        if launch.spawn:
            import torch.multiprocessing as mp

            ctx = mp.get_context("spawn")
            for r in range(1, launch.place.size):
                peer = Launch(Place(r, launch.place.size), launch.address, launch.port)
                p = ctx.Process(target=rank_main, args=(config, peer), name=f"hotprefix-rank-{r}", daemon=True)
                p.start()
                log.info("tensor parallel: rank %d of %d started (pid %d)", r, launch.place.size, p.pid)
                self.procs.append(p)
        try:
            self.parallel = _join(launch, config.model, self.exited)
        except PeerLostError:
            self.close()
            raise

    def exited(self) -> str | None:
        """Which spawned ranks have exited, and with what status (None: none has)."""
        gone = [f"rank {r} of {len(self.procs) + 1} exited with status {p.exitcode}"
                for r, p in enumerate(self.procs, 1) if p.exitcode is not None]
        return "; ".join(gone) or None

    @property
    def pids(self) -> list[int]:
        """The spawned ranks' process ids, rank 1 first."""
        return [p.pid for p in self.procs]

    def close(self, runner: ModelRunner | None = None) -> None:
        """Stop the other ranks (`runner`'s Stop, when it was built), wait for the spawned ones
        to leave, kill the ones that do not."""
        if runner is not None:
            runner.close()
        for p in self.procs:
            p.join(JOIN_SECONDS)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []


def start_runner(config: EngineConfig, launch: Launch, loaded: LoadedModel, eos: tuple[int, ...],
                 grammars: GrammarCompiler) -> tuple[Ranks, ModelRunner]:
    """Rank 0: the other ranks (spawned and joined; none with one) and its runner over them.
    Raises what ModelRunner raises (the spawned ranks are stopped first) or PeerLostError."""
    ranks = Ranks(config, launch)
    try:
        return ranks, ModelRunner(loaded, config.model, config.cache, config.scheduler, eos, grammars, ranks.parallel)
    except BaseException:
        ranks.close()
        raise


def rank_main(config: EngineConfig, launch: Launch) -> None:
    """A rank other than 0: load its part of the model, join the group, build its runner
    and follow rank 0 until Stop. Raises PeerLostError when rank 0 is gone (the process
    then exits non-zero)."""
    logging.basicConfig(level=logging.INFO, format=f"rank {launch.place.rank}: %(levelname)s %(name)s: %(message)s")
    mc = config.model
    parallel = _join(launch, mc)  # first: rank 0 waits for the group, not for this rank's load
    try:
        loaded = load_rank(mc, launch.place)
        sched = config.scheduler.resolved(mc.context_length(loaded.arch.max_position_embeddings))
        runner = ModelRunner(loaded, mc, config.cache, sched, parallel=parallel)
        del loaded  # the runner holds what it keeps
        runner.follow()
    finally:
        parallel.close()
