"""`medusa-chat ui` (also `medusa-chat` alone): the chat in a window of its own, served on this machine.

The host and port are checked before anything heavy loads (`check`). The server (the chat and
the OpenAI-compatible API, `app.server`) then starts while the model loads, and keeps running in
the background; stderr says when the model is ready. `_present` shows the page in a native
window (or a browser tab, saying why, or nowhere, saying so) and returns when the window is
closed or on Ctrl-C or SIGTERM, after which the server and the model's thread are stopped.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import webbrowser
from concurrent.futures import Future

from app.cli.options import model_options
from app.listen import checked_port, port_number

HELP = "open the chat in its own window or the browser (the default command)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: this machine only)")
    p.add_argument("--port", type=port_number, default=None, help="port (default: 7860 or the next free one)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require this key on the API (Authorization: Bearer KEY); default: $MEDUSA_CHAT_API_KEY, "
        "or a new one printed at start when --host reaches beyond this machine",
    )
    p.add_argument("--no-window", action="store_true", help="open a browser tab instead of a window of its own")
    p.add_argument("--no-browser", action="store_true", help="only serve the chat: no window, no browser tab")
    p.add_argument(
        "--no-past-replies",
        action="store_true",
        help="draft only from the model's shipped replies, not from your saved chats and this session's replies",
    )
    model_options(p)


def check(args: argparse.Namespace) -> None:
    """Before anything heavy is imported: the host and port can be listened on (the first free
    port from 7860 is picked without --port), or one sentence says why not."""
    args.port = checked_port(args.host, args.port)


def run(args: argparse.Namespace) -> int:
    from app.engine import Engine
    from app.guard import api_key
    from app.server import start
    from app.store import saved_replies

    port = args.port  # free a moment ago (`check`)
    key = api_key(args.host, port, args.api_key)  # checked, and announced beyond loopback, before the model loads
    past = None if args.no_past_replies else saved_replies
    engine = Engine(
        args.model, args.dtype, args.device, args.quantization, args.heads, past, args.eagle, args.draft_model
    )
    signal.signal(signal.SIGTERM, _interrupt)  # from here on SIGTERM stops the app as Ctrl-C does
    # and Ctrl-C does, as the app says, even where it was started with SIGINT ignored (a background
    # job of a non-interactive shell), where Python leaves SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    loading = engine.start()
    try:
        server = start(engine, args.host, port, key)
    except BaseException as e:  # the port was taken since `check`, say, or Ctrl-C
        _end_if_loading(engine, e)
        raise
    url = server.url
    print(f"medusa-chat is running at {url} (API: {url}/v1; Ctrl-C to quit)", file=sys.stderr, flush=True)
    loading.add_done_callback(lambda done: _announce(done, engine, url))
    try:
        _present(url, args)
    except KeyboardInterrupt:
        pass
    except BaseException as e:
        _end_if_loading(engine, e)
        server.close()
        raise
    _end_if_loading(engine)
    server.close()
    print("medusa-chat stopped.", file=sys.stderr)
    return 0


def _announce(loading: Future, engine, url: str) -> None:
    """Say on stderr when the first model has loaded (or could not be)."""
    if loading.cancelled():
        return
    if engine.error:
        print(f"not ready: {engine.error} The chat stays open to choose another model.", file=sys.stderr, flush=True)
    else:
        print(f"ready: model {engine.model_id} on {url}", file=sys.stderr, flush=True)


def _end_if_loading(engine, error: BaseException | None = None) -> None:
    """End the process at once, saying what it would have said, while the first model is still
    loading: loading cannot be stopped midway, a process exiting while torch works on another
    thread aborts ("terminate called without an active exception"), and nothing is unsaved yet
    (no reply can have started). Otherwise return, for the usual clean stop."""
    if engine.loaded is not None or engine.error is not None or engine.close(timeout=0.5):
        return
    from app.main import report

    code = report(error) if error is not None else 0
    if error is None:
        print("medusa-chat stopped.", file=sys.stderr)  # as after a clean stop
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _present(url: str, args: argparse.Namespace) -> None:
    """Show the running chat at `url` and block: until its window is closed, or until Ctrl-C
    when it is in a browser tab (the fallback, with one sentence saying why) or not shown."""
    from app.window import APP_ID, icon, run_window, window_problem

    if args.no_browser:
        print(f"No window or browser tab opens (--no-browser); the chat is at {url}.", file=sys.stderr, flush=True)
        _wait_for_interrupt()
        return
    problem = window_problem(args.no_window)
    if problem is None:
        try:
            run_window(url, APP_ID, icon())
            return
        except Exception as e:  # Qt or its web view failing to load, e.g. a system library missing
            problem = f"the window failed to open ({type(e).__name__}: {e})"
    if _can_browse() and webbrowser.open(url):
        print(f"The chat opened in the browser instead of a window: {problem}.", file=sys.stderr, flush=True)
    else:
        print(f"No window ({problem}) and no browser tab opens; the chat is at {url}.", file=sys.stderr, flush=True)
    _wait_for_interrupt()


def _can_browse() -> bool:
    """Whether a browser may be opened: the one $BROWSER names, or on Linux a graphical one only
    with a display (without one, `webbrowser` would run a text browser such as lynx inside this
    terminal, or find none)."""
    graphical = os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    return bool(os.environ.get("BROWSER") or graphical or not sys.platform.startswith("linux"))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wait_for_interrupt() -> None:
    """Block until Ctrl-C or SIGTERM, which end the app the same clean way."""
    signal.signal(signal.SIGTERM, _interrupt)  # again: the window, when it fails, may leave its own
    threading.Event().wait()  # Ctrl-C raises KeyboardInterrupt here
