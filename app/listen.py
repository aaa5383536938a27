"""Whether the server can listen on a host and port, found out before anything loads.

A socket is bound the way uvicorn binds its own (every address the host name gives, with
SO_REUSEADDR) and closed again at once, so a port that is taken, a host name that does not
resolve, an address that is not this machine's or a port that needs administrator rights is
one sentence before the model starts loading. Only sockets here: no torch, no web framework.
"""

from __future__ import annotations

import argparse
import errno
import socket

from core.errors import UserError

FIRST_PORT, TRIED = 7860, 100  # without --port: the first free one of 7860…7959


def port_number(text: str) -> int:
    """--port: a whole number from 1 to 65535, else a usage error."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {text!r}")
    return port


def checked_port(host: str, port: int | None) -> int:
    """`port` once a socket could listen on it at `host` (None: the first free one from
    FIRST_PORT); a UserError naming the cause where it cannot."""
    if port is not None:
        _try_bind(host, port)
        return port
    for candidate in range(FIRST_PORT, FIRST_PORT + TRIED):
        try:
            _try_bind(host, candidate)
        except _Taken:
            continue
        return candidate
    raise UserError(f"No free port between {FIRST_PORT} and {FIRST_PORT + TRIED - 1} on {host}; pass --port.")


class _Taken(UserError):
    """The port is in use."""


def why_not(host: str, port: int) -> str | None:
    """The sentence saying why nothing can listen on host:port now, or None if something can."""
    try:
        _try_bind(host, port)
    except UserError as e:
        return str(e)
    return None


def _try_bind(host: str, port: int) -> None:
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else "not a valid host name"
        raise UserError(
            f"Unknown host '{host}' ({reason}); pass --host 127.0.0.1 (this machine only), 0.0.0.0 "
            "(every interface) or a name of this machine."
        ) from None
    for family, kind, proto, _, address in dict.fromkeys((f, k, p, "", a) for f, k, p, _, a in found):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise _sentence(e, host, port) from None


def _sentence(error: OSError, host: str, port: int) -> UserError:
    if error.errno == errno.EADDRINUSE:
        return _Taken(f"Port {port} is already in use on {host}; pass another --port, or none for the next free one.")
    if error.errno == errno.EACCES:
        return UserError(
            f"Listening on port {port} is not permitted here (ports below 1024 need administrator rights); "
            "pass a --port above 1023."
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return UserError(
            f"{host} is not an address of this machine; pass --host 127.0.0.1 (this machine only) or 0.0.0.0 "
            "(every interface)."
        )
    return UserError(f"Cannot listen on {host}:{port} ({error.strerror or error}); pass another --host or --port.")
