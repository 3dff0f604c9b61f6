"""`hetero serve`: an OpenAI-compatible HTTP server over one engine.

Why FastAPI on uvicorn: it is the stack vLLM and SGLang serve with, so its behaviour (SSE
through `StreamingResponse`, a client's disconnect cancelling the stream's task, HTTP/1.1
keep-alive) is what OpenAI clients are used to; pydantic models validate request bodies in
one place, and its exception handlers turn every bad request into an OpenAI-shaped error
instead of a traceback. The engine itself runs on its own thread (`EngineLoop`); handlers only
tokenize, submit, and relay tokens, so the event loop never waits for a step.

The model loads on a background thread after the port is open: `/health` answers 503 until
the engine is ready (as llama-server and vLLM do), then 200.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from hetero.app.engine_loop import EngineLoop
from hetero.app.http_api import build_app
from hetero.app.live import LiveStats
from hetero.app.engine import Engine
from hetero.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 4  # sequences decoded together
    queue: int = 64  # requests that may wait beyond those; more get 503 and Retry-After
    max_new_tokens: int | None = None  # a request's default max_tokens (None: until the context ends)
    model_name: str | None = None  # the id /v1/models reports (default: the model file's or folder's name)
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise UserError(f"--parallel {self.parallel}: serve at least 1 sequence at a time")
        if self.queue < 0:
            raise UserError(f"--queue {self.queue}: the queue holds 0 or more requests")
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port} is not a TCP port (0–65535)")


@dataclass
class ServerState:
    """What the HTTP handlers share: the engine (None while loading), its loop, the live numbers."""

    opts: ServeOptions
    live: LiveStats = field(default_factory=LiveStats)
    engine: Engine | None = None
    loop: EngineLoop | None = None
    model_name: str = ""
    error: BaseException | None = None

    def start(self, engine: Engine) -> None:
        from pathlib import Path

        self.model_name = self.opts.model_name or Path(engine.info.get("model", "model")).stem
        self.live.info = {**engine.info, "split": _split(engine), "parallel": self.opts.parallel}
        if engine.runner.cuda:  # GPU busy comes from CUDA events around the GPU segments
            engine.runner.spans.enabled = engine.runner.xfer.enabled = True
        # one short generation before /health says ready: kernels compile (or load from their
        # cache) and graphs capture now, not during the first client's request
        for _ in engine.generate([[engine.cfg.bos_token_id or 1] * 4], max_new_tokens=2, temperature=0.0):
            pass
        self.loop = EngineLoop(engine, self.live, self.opts.parallel, self.opts.queue)
        self.loop.start()
        self.engine = engine
        self.live.loaded = True

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.stop()


def _split(engine: Engine) -> dict[str, int]:
    """KV tokens per sequence on each tier, as the plan (or the CPU path's options) put them."""
    if engine.plan is not None:
        return {"gpu": engine.plan.kv.gpu_tokens, "cpu": engine.plan.kv.host_tokens}
    gpu = engine.cache.gpu_tokens_per_seq if engine.cache.gpu is not None else 0
    return {"gpu": gpu, "cpu": engine.ctx_size - gpu}


def serve(load: Callable[[], Engine], opts: ServeOptions) -> None:
    """Open the port, load the engine meanwhile, serve until Ctrl+C. A load that fails (a bad
    model path, a plan that cannot fit) stops the server and is raised here."""
    import uvicorn

    state = ServerState(opts)
    app = build_app(state)
    server = uvicorn.Server(uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                                           timeout_graceful_shutdown=3))

    def load_engine() -> None:
        try:
            t0 = time.perf_counter()
            engine = load()
            state.start(engine)
            log.warning("hetero serve: %s ready in %.1f s on http://%s:%d", state.model_name,
                        time.perf_counter() - t0, opts.host, opts.port)
        except BaseException as e:  # noqa: BLE001 - reported by serve() after the server stops
            state.error = e
            server.should_exit = True

    threading.Thread(target=load_engine, name="hetero-load", daemon=True).start()
    try:
        server.run()
    finally:
        state.stop()
    if state.error is not None:
        raise state.error
    if not server.started:
        raise UserError(f"could not listen on {opts.host}:{opts.port}: is another server using it? "
                        f"Pick another --port")

