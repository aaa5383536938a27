"""`medusa-chat ui` (also `medusa-chat` alone): the chat in a window of its own, served on this machine.

The server (the chat and the OpenAI-compatible API, `app.server`) starts first and keeps running
in the background; `_present` then shows its page in a native window (or a browser tab, saying
why, or nowhere with --no-browser) and returns when the window is closed or on Ctrl-C, after
which the server and the model's thread are stopped.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import webbrowser

from app.cli.options import model_options
from core.errors import UserError

HELP = "open the chat in its own window or the browser (the default command)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=None, help="port (default: 7860 or the next free one)")
    p.add_argument("--no-window", action="store_true", help="open a browser tab instead of a window of its own")
    p.add_argument("--no-browser", action="store_true", help="only serve the chat: no window, no browser tab")
    p.add_argument(
        "--no-past-replies",
        action="store_true",
        help="draft only from the model's shipped replies, not from your saved chats and this session's replies",
    )
    model_options(p)


def _free_port(host: str, start: int = 7860) -> int:
    import socket

    for port in range(start, start + 100):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise UserError(f"No free port between {start} and {start + 99}; pass --port.")


def run(args: argparse.Namespace) -> int:
    from app.engine import Engine
    from app.server import start
    from app.store import saved_replies

    port = args.port or _free_port(args.host)
    past = None if args.no_past_replies else saved_replies
    engine = Engine(args.model, args.dtype, args.device, args.quantization, args.heads, past, args.eagle)
    engine.start()
    server = start(engine, args.host, port)
    url = server.url
    print(f"medusa-chat is running at {url} (API: {url}/v1; Ctrl-C to quit)", file=sys.stderr, flush=True)
    try:
        _present(url, args)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    print("medusa-chat stopped.", file=sys.stderr)
    return 0


def _present(url: str, args: argparse.Namespace) -> None:
    """Show the running chat at `url` and block: until its window is closed, or until Ctrl-C
    when it is in a browser tab (the fallback, with one sentence saying why) or not shown."""
    from app.window import APP_ID, icon, run_window, window_problem

    if args.no_browser:
        _wait_for_interrupt()
        return
    problem = window_problem(args.no_window)
    if problem is None:
        try:
            run_window(url, APP_ID, icon())
            return
        except Exception as e:  # Qt or its web view failing to load, e.g. a system library missing
            problem = f"the window failed to open ({type(e).__name__}: {e})"
    print(f"Opening the chat in the browser instead of a window: {problem}.", file=sys.stderr, flush=True)
    webbrowser.open(url)
    _wait_for_interrupt()


def _wait_for_interrupt() -> None:
    """Block until Ctrl-C or SIGTERM, which end the app the same clean way."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    threading.Event().wait()  # Ctrl-C raises KeyboardInterrupt here
