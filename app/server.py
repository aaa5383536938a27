"""The one local web server: the chat page and the OpenAI-compatible API on one port.

A FastAPI app holds the API's routes (`app.api`) and mounts the Gradio chat at `/` with
Gradio's documented `gr.mount_gradio_app`; uvicorn serves it from a thread of its own, so the
caller's thread stays free (for Ctrl-C, or a window). The chat and the API reach the model
through the same `Engine`, whose one compute thread runs one reply at a time.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

import gradio as gr
import uvicorn
from fastapi import FastAPI

from app import api
from app.engine import Engine
from app.guard import Guard, policy
from app.listen import why_not
from app.ui import build, css
from core.errors import UserError

SHUTDOWN_SECONDS = 3  # open connections (a tab's heartbeat, a stream) get this long to finish on close


@dataclass
class Server:
    url: str  # where this machine reaches the chat; the API is under url + "/v1"
    _uvicorn: uvicorn.Server
    _thread: threading.Thread
    _engine: Engine
    _demo: gr.Blocks

    def wait(self) -> None:
        """Block until the server stops; Ctrl-C raises KeyboardInterrupt here, in the caller's thread."""
        while self._thread.is_alive():
            self._thread.join(0.5)

    def close(self) -> None:
        """End the engine's work first (a reply in progress stops at its next step, as with Stop,
        and the chat saves what was written; a model still loading is waited for), let the
        handlers saving it finish, then stop serving (open connections closed after
        SHUTDOWN_SECONDS at most), so the process exits cleanly."""
        if not self._engine.close(timeout=1):
            print("Waiting for the model to finish its current job (such as loading)…", file=sys.stderr, flush=True)
            self._engine.close()
        _finish_handlers(self._demo)
        self._uvicorn.should_exit = True
        self._thread.join(SHUTDOWN_SECONDS + 5)


def _finish_handlers(demo: gr.Blocks, timeout: float = 5.0) -> None:
    """Wait for the chat's event handlers still running, such as the one saving the reply just
    stopped: closing the server would drop them midway. Gradio has no public way to ask, hence `_queue`."""
    jobs = getattr(getattr(demo, "_queue", None), "active_jobs", None)  # one slot per worker, None when idle
    deadline = time.monotonic() + timeout
    while jobs and any(job is not None for job in jobs) and time.monotonic() < deadline:
        time.sleep(0.05)


def start(engine: Engine, host: str = "127.0.0.1", port: int = 7860, api_key: str | None = None) -> Server:
    """Serve the chat and the API for `engine` on host:port, returning once it accepts connections.
    Every route is behind `app.guard`: this server's own host names and page only, and `api_key`
    (None: none) for /v1."""
    demo = build(engine)
    demo.queue(default_concurrency_limit=1)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the API follows OpenAI's schema, no own docs
    app.include_router(api.router(engine))
    gr.mount_gradio_app(app, demo, path="/", server_name=host, server_port=port, css=css(), show_error=False)
    guarded = Guard(app, policy(host, port, api_key))  # outermost: refused before Gradio's own CORS answers
    config = uvicorn.Config(
        guarded, host=host, port=port, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_SECONDS
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="medusa-chat-server", daemon=True)
    thread.start()
    while not server.started:  # uvicorn logs why it could not start and ends its thread
        if not thread.is_alive():
            # the port was free when `app.listen` checked it before the model loaded: ask again why
            raise UserError(why_not(host, port) or f"The server could not start on {host}:{port}; pass another --port.")
        time.sleep(0.02)
    return Server(_local_url(host, port), server, thread, engine, demo)


def _local_url(host: str, port: int) -> str:
    """The address this machine opens: a server on every interface is reached through loopback."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"
