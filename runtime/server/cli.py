"""``trtbuild serve``: run the OpenAI-compatible server (uvicorn) over an engine dir."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import click

from ..cli import MULTI_STEP


class _DrainingServer:
    """uvicorn's server with SIGTERM/SIGINT as a drain: new requests get 503, in-flight ones finish
    for up to ``grace`` seconds, then the server stops (a second signal stops it at once)."""

    def __init__(self, config, state, grace: float):
        import uvicorn

        server = self
        class Server(uvicorn.Server):  # noqa: E306  (a subclass bound to this drain)
            def handle_exit(self, sig, frame):
                if state.draining:
                    return super().handle_exit(sig, frame)
                state.draining = True
                threading.Thread(target=server._drain, args=(self,), daemon=True).start()

        self.server, self.state, self.grace = Server(config), state, grace

    def _drain(self, server) -> None:
        deadline = time.monotonic() + self.grace
        while self.state.inflight and time.monotonic() < deadline:
            time.sleep(0.05)
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
              help="Requests waiting for a KV slot beyond which new ones get 429 with Retry-After.")
@click.option("--grace", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds in-flight requests may take to finish after SIGTERM.")
@click.option("--backend", type=click.Choice(["auto", "tensorrt", "onnxruntime"]), default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(min=0), default=0, help="CPU threads for onnxruntime (0: all cores).")
@MULTI_STEP
def serve(engine_dir: Path, host: str, port: int, api_key: str | None, model_name: str | None, max_queue: int,
          grace: float, backend: str, threads: int, multi_step: int | None):
    """Serve ENGINE_DIR over HTTP with the OpenAI API: /v1/completions, /v1/chat/completions
    (streaming with SSE), /v1/models, /health, /metrics (Prometheus).

    \\b
    Example:
      trtbuild serve build/tiny-code --port 8000
      curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-code", "prompt": "def fibonacci(n):", "max_tokens": 32}'
    """
    import uvicorn

    from ..async_llm import AsyncLLM
    from ..engine_dir import EngineDirError
    from ..llm import LLM
    from .app import create_app

    try:
        llm = LLM(engine_dir, backend=backend, threads=threads, multi_step=multi_step)
    except (EngineDirError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    name = model_name or Path(engine_dir).resolve().name
    app = create_app(AsyncLLM(llm), name, api_key=api_key, max_queue=max_queue)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=max(1, int(grace)))
    server = _DrainingServer(config, app.state.trtbuild, grace)
    click.echo(f"trtbuild serve: {name} ({llm.backend_label}) on http://{host}:{port}", err=True)
    try:
        server.run()
    finally:
        llm.close()
