"""``trtbuild serve``: run the OpenAI-compatible server (uvicorn) over an engine dir."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from ..runtime.structured.compile_pool import MAX_WAITING, WORKERS
from .run_commands import KV_CACHE_MEMORY, MULTI_STEP, SPECULATION


STOP_WAIT_S = 2.0   # after the grace period: time for open responses to send their shutdown error


class _DrainingServer:
    """uvicorn's server with SIGTERM/SIGINT as a drain: new requests get 503, in-flight ones finish
    for up to ``grace`` seconds, then whatever is still open ends with a shutdown error and the
    server stops. A second signal stops it at once. ``announce`` hears the port actually bound."""

    def __init__(self, config, state, grace: float, announce):
        import uvicorn

        drain = self._drain
        class Server(uvicorn.Server):  # noqa: E306  (a subclass bound to this drain)
            async def startup(self, sockets=None) -> None:
                self.loop = asyncio.get_running_loop()
                await super().startup(sockets)
                if self.started:
                    announce(self.servers[0].sockets[0].getsockname()[1])

            def handle_exit(self, sig, frame):
                # Not uvicorn's own handling: it would re-raise the signal after the loop ends
                # (a SIGINT then dies with a KeyboardInterrupt traceback, a SIGTERM with -15).
                if state.draining:
                    self.force_exit = self.should_exit = True
                    return
                state.draining = True
                self.loop.call_soon_threadsafe(lambda: self.drain_tasks.add(self.loop.create_task(drain(self))))

        self.server, self.state, self.grace = Server(config), state, grace
        self.server.drain_tasks = set()   # held so the drain task is not collected

    async def _drain(self, server) -> None:
        """Waits out the grace period (or a second signal), then ends what is still open with a
        shutdown error event / 503 so no client sees a bare closed connection."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        while self.state.inflight and loop.time() < deadline and not server.should_exit:
            await asyncio.sleep(0.05)
        if self.state.inflight:
            self.state.stop()
            deadline = loop.time() + STOP_WAIT_S
            while self.state.inflight and loop.time() < deadline and not server.should_exit:
                await asyncio.sleep(0.02)
        server.should_exit = True

    def run(self) -> None:
        self.server.run()


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 picks a free port.")
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on every route but /health.")
@click.option("--model-name", default=None, help="The model id clients send (default: the engine dir's name).")
@click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests waiting for a KV slot (counted from when they are accepted) beyond which new ones "
                   "get 429 with Retry-After; one request asking for more (prompts x n) gets 400.")
@click.option("--grace", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds in-flight requests may take to finish after SIGTERM; then they end with an error.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=4 * 1024 * 1024, show_default=True,
              help="Largest request body; a larger one gets 413, read no further than the limit.")
@click.option("--max-prompt-chars", type=click.IntRange(min=1), default=262144, show_default=True,
              help="Longest text prompt (chat: all message contents together); a longer one gets 400 before "
                   "it is tokenized.")
@click.option("--header-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds a connection may take to send a request's headers before it is closed.")
@click.option("--body-timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Seconds per MB of its declared Content-Length (of --max-body-bytes when chunked; at least one "
                   "MB's worth) a request body may take to arrive; a slower one gets 408 and the connection closes.")
@click.option("--compile-timeout", type=click.FloatRange(min=0.001), default=10.0, show_default=True,
              help="Seconds a request's response_format / structured_outputs / tools constraint may take to compile, "
                   "from when a compile thread starts it (time waiting for one not counted); a slower one gets 400.")
@click.option("--compile-workers", type=click.IntRange(min=1), default=WORKERS, show_default=True,
              help="Threads compiling constraints at once (each compile holds a core while it runs).")
@click.option("--compile-waiting", type=click.IntRange(min=0), default=MAX_WAITING, show_default=True,
              help="Constraint compiles that may wait for a thread; past that a request with a new constraint gets 503.")
@click.option("--backend", type=click.Choice(["auto", "tensorrt", "onnxruntime"]), default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(min=0), default=0, help="CPU threads for onnxruntime (0: all cores).")
@SPECULATION
@MULTI_STEP
@KV_CACHE_MEMORY
def serve(engine_dir: Path, host: str, port: int, api_key: str | None, model_name: str | None, max_queue: int,
          grace: float, max_body_bytes: int, max_prompt_chars: int, header_timeout: float, body_timeout: float,
          compile_timeout: float, compile_workers: int, compile_waiting: int, backend: str, threads: int,
          speculation, speculation_mode: str, draft_tree_width: int | None, multi_step: int | None, kv_cache_memory):
    """Serve ENGINE_DIR over HTTP with the OpenAI API: /v1/completions, /v1/chat/completions
    (streaming with SSE), /v1/models, /health, /metrics (Prometheus).

    \b
    Example:
      trtbuild serve build/tiny-code --port 8000
      curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-code", "prompt": "def fibonacci(n):", "max_tokens": 32}'
    """
    import uvicorn

    from ..plugins.onnxruntime.session import Spinning
    from ..runtime.async_llm import AsyncLLM
    from ..runtime.engine_dir import EngineDirError
    from ..runtime.llm import LLM
    from ..runtime.server.app import create_app
    from ..runtime.server.connections import with_header_timeout
    from ..runtime.server.inputs import Limits
    from ..runtime.speculation.adaptive import SpeculationMode
    from ..runtime.structured import CompilePool

    try:
        # Sleeping ONNX Runtime threads: spinning ones keep both cores of a small machine busy
        # between steps, while the event loop needs them to stream (benchmarks/serve_load.py at 8
        # in flight: 1227 → 2281 tok/s, 0.91 → 0.43 CPU ms per token).
        llm = LLM(engine_dir, backend=backend, threads=threads, multi_step=multi_step, spinning=Spinning.never,
                  speculation=speculation, speculation_mode=SpeculationMode(speculation_mode),
                  kv_cache_memory=kv_cache_memory, draft_tree_width=draft_tree_width)
    except (EngineDirError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    llm.compile_pool = CompilePool(llm.constraints, compile_workers, compile_waiting, compile_timeout)  # no thread ran yet
    name = model_name or Path(engine_dir).resolve().name
    limits = Limits(max_body_bytes=max_body_bytes, max_prompt_chars=max_prompt_chars, max_queue=max_queue,
                    body_timeout=body_timeout, compile_timeout=compile_timeout)
    app = create_app(AsyncLLM(llm), name, limits, api_key=api_key)
    # The drain serves the grace period; uvicorn's own graceful wait only closes what is left.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=1, lifespan="off",
                            http=with_header_timeout(header_timeout))
    shown = f"[{host}]" if ":" in host else host
    announce = lambda bound: click.echo(f"trtbuild serve: {name} ({llm.backend_label}) on http://{shown}:{bound}",  # noqa: E731
                                        err=True)
    server = _DrainingServer(config, app.state.trtbuild, grace, announce)
    try:
        server.run()
    finally:
        app.state.trtbuild.workers.shutdown(wait=False, cancel_futures=True)
        llm.close()
