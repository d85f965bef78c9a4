"""`hotprefix serve`: load the model, size the pool, start uvicorn."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import uvicorn

from hotprefix.config import EngineConfig, ServerConfig
from hotprefix.engine.async_engine import AsyncEngine
from hotprefix.engine.llm_engine import LLMEngine
from hotprefix.server.app import build_app
from hotprefix.server.log_lines import escape_log_lines
from hotprefix.tokenizers.fast_tokenizer import preload_renderer

log = logging.getLogger(__name__)


def _preload_renderer() -> None:
    """transformers' chat template renderer, imported once the server is up rather than at
    the first chat request (a chat request arriving meanwhile waits for it)."""
    t0 = time.monotonic()
    try:
        preload_renderer()
    except Exception as e:  # (an import that fails here fails again, with its error, at the first chat request)
        log.warning("chat template renderer not imported ahead: %s", e)
        return
    log.info("chat template renderer (transformers) imported in %.1fs, after the start", time.monotonic() - t0)


def runs_on_cpu(engine_cfg: EngineConfig) -> bool:
    """Whether the engine will run on the CPU (its --device, auto: CUDA when there is one)."""
    import torch

    device = engine_cfg.model.device
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def make_server(engine_cfg: EngineConfig, cfg: ServerConfig) -> uvicorn.Server:
    """Load the engine and build the uvicorn server (not started). Raises
    ModelLoadError / ConfigError with a one-line message."""
    t0 = time.monotonic()
    log.info("loading %s ...", engine_cfg.model.model or "the default model (SmolLM2-135M-Instruct)")
    # The engine thread loads, warms up and runs the model: it alone runs torch (see AsyncEngine.load).
    async_engine = AsyncEngine.load(lambda: LLMEngine(engine_cfg, warmup=False), cfg.admission)
    if cfg.chat_template is not None:  # a broken --chat-template fails the start, not the first request
        async_engine.check_chat_template(cfg.chat_template)
    app = build_app(async_engine, cfg)
    log.info("ready to serve after %.1fs", time.monotonic() - t0)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.uvicorn_log_level,
                            timeout_graceful_shutdown=cfg.shutdown_timeout, access_log=False,
                            root_path=cfg.root_path, ssl_keyfile=cfg.ssl_keyfile, ssl_certfile=cfg.ssl_certfile,
                            ssl_ca_certs=cfg.ssl_ca_certs, timeout_keep_alive=cfg.timeout_keep_alive)
    escape_log_lines()  # (uvicorn's handlers are set up by its Config)
    return uvicorn.Server(config)


def _exit_when_dead(engine: AsyncEngine, server: uvicorn.Server) -> None:
    """Stop the server once the engine is dead (its requests have failed already)."""
    engine.wait_dead()
    log.error("the engine died (%s): the server stops", engine.dead)
    server.should_exit = True


def serve(engine_cfg: EngineConfig, cfg: ServerConfig, started: Callable[[], None] = lambda: None) -> int:
    """Run until SIGINT/SIGTERM: then stop accepting, let running requests
    finish for up to cfg.shutdown_timeout seconds, and exit; or until the engine dies (a
    lost tensor-parallel rank). `started` is called once the engine is warm and the
    server built, before it listens (cli.collector_paused's end). Returns the exit status:
    1 when the engine died, else 0."""
    server = make_server(engine_cfg, cfg)
    engine = server.config.app.state.engine
    server.config.load()  # uvicorn's own imports (run() does not load it again), then the renderer's beside it
    started()
    threading.Thread(target=_preload_renderer, name="hotprefix-renderer-import", daemon=True).start()
    threading.Thread(target=_exit_when_dead, args=(engine, server), name="hotprefix-engine-watch", daemon=True).start()
    server.run()
    return 1 if engine.dead is not None else 0
