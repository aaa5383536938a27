"""`medusa-chat ui` (also `medusa-chat` alone): the chat in the browser and an OpenAI-compatible API, served here."""

from __future__ import annotations

import argparse
import sys

from app.cli.options import model_options
from core.errors import UserError

HELP = "open the chat in the browser (the default command)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=None, help="port (default: 7860 or the next free one)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
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
    import webbrowser

    from app.engine import Engine
    from app.server import start

    port = args.port or _free_port(args.host)
    engine = Engine(args.model, args.dtype, args.device, args.quantization, args.heads)
    engine.start()
    server = start(engine, args.host, port)
    print(f"medusa-chat is running at {server.url} (API: {server.url}/v1; Ctrl-C to quit)", file=sys.stderr, flush=True)
    try:
        if not args.no_browser:
            webbrowser.open(server.url)
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    print("medusa-chat stopped.", file=sys.stderr)
    return 0
