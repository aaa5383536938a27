"""The server's door: which requests reach the chat page and the API at all.

Any web page the user visits can send requests to this machine: a cross-site `fetch` to
127.0.0.1, or DNS rebinding (evil.example made to resolve to 127.0.0.1, so the page counts as
same-origin). `Guard`, pure ASGI around the whole app (the Gradio chat with all its routes, and
`/v1`), lets through only requests addressed to this server by a name of its own (the `Host`
header: 127.0.0.1, localhost or [::1] with the served port, or the --host given) and, when a
browser says where a request comes from (`Origin`), only those from the app's own page. Under
`/v1` it also asks for the API key when one is set and refuses a body over MAX_BODY bytes
before reading it. Every refusal is an OpenAI-style error object, one sentence.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from core.errors import UserError

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY = 4 * 1024 * 1024  # bytes of a /v1 request body: a long conversation is well under 1 MB
KEY_ENV = "MEDUSA_CHAT_API_KEY"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
EVERY_INTERFACE = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Policy:
    port: int  # the served port, which Host and Origin must carry
    names: frozenset[str]  # host names a request may address (lowercase, IPv6 in brackets)
    every_interface: bool  # bound to 0.0.0.0 or "::"; then also any IP address and this machine's own names
    api_key: str | None  # what /v1 requires as `Authorization: Bearer …`; None: no key


def policy(host: str, port: int, api_key: str | None = None) -> Policy:
    """Who may talk to a server bound to host:port."""
    names = set(LOOPBACK_NAMES)
    every = host in EVERY_INTERFACE
    if every:
        names |= {socket.gethostname().lower(), f"{socket.gethostname().lower()}.local"}
    else:
        names.add(_bracketed(host.lower()))
    return Policy(port, frozenset(names), every, api_key)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


def host_allowed(p: Policy, hostport: str) -> bool:
    """Whether `hostport` (a Host header, or an Origin without its scheme) names this server."""
    name, sep, port = hostport.lower().rpartition(":")
    if not sep or port != str(p.port) or (name.startswith("[") != name.endswith("]")):
        return False  # no port (or an IPv6 address without one): not how a browser reaches this port
    return name in p.names or (p.every_interface and _is_ip(name))


def refusal(p: Policy, headers: dict[str, str]) -> str | None:
    """Why a request with these headers may not reach the app (one sentence), or None."""
    host = headers.get("host", "")
    if not host_allowed(p, host):
        names = "an IP address or this machine's name" if p.every_interface else ", ".join(sorted(p.names))
        return f"This server answers only requests addressed to it as {names} on port {p.port}; this one is refused."
    origin = headers.get("origin")
    if origin is not None and not (origin == f"http://{host}" or _own_origin(p, origin)):
        return f"This server answers only its own page; a request from the web page at {origin[:80]!r} is refused."
    return None


def _own_origin(p: Policy, origin: str) -> bool:
    scheme, sep, hostport = origin.partition("://")
    return sep != "" and scheme == "http" and hostport.lower() in {f"{n}:{p.port}" for n in p.names}


def key_refusal(p: Policy, headers: dict[str, str]) -> str | None:
    """Why an API request lacks the key (one sentence), or None when it has it or none is set."""
    if p.api_key is None:
        return None
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), p.api_key.encode()):
        return None
    return f"This API needs its key: send 'Authorization: Bearer KEY' with the key given by --api-key or {KEY_ENV}."


class Guard:
    """ASGI middleware around the whole app: refuses what `refusal` and, under /v1, `key_refusal`
    and the body limit say, before the app sees the request."""

    def __init__(self, app: ASGIApp, p: Policy) -> None:
        self.app, self.policy = app, p

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        problem = refusal(self.policy, headers)
        if problem is None and _is_api(scope["path"]):
            if (problem := key_refusal(self.policy, headers)) is not None:
                await _refuse(scope, receive, send, 401, problem, "invalid_api_key")
                return
            if scope["type"] == "http" and scope["method"] == "POST":
                receive, problem = await _buffered(headers, receive)
                if problem is not None:
                    await _refuse(scope, receive, send, 413, problem, "request_too_large")
                    return
        if problem is not None:
            await _refuse(scope, receive, send, 403, problem, "forbidden")
            return
        await self.app(scope, receive, send)


def _is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


async def _buffered(headers: dict[str, str], receive: Receive) -> tuple[Receive, str | None]:
    """The request body read up to MAX_BODY bytes, replayed to the app (then the client's own
    messages, such as its disconnect); or why it is refused, before reading any more of it."""
    too_large = f"The request body is over {MAX_BODY // (1024 * 1024)} MB; send a shorter conversation."
    length = headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
        return receive, too_large
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client left while sending
            return _replay([message], receive), None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > MAX_BODY:
            return receive, too_large
    return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive), None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str) -> None:
    if scope["type"] == "websocket":  # closing before accepting: the server answers 403
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status == 413:  # the rest of the body is not read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


# ---- binding beyond this machine: the key and the warning ----


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may well reach other machines


def api_key(host: str, port: int, given: str | None) -> str | None:
    """The key /v1 requires: --api-key, else $MEDUSA_CHAT_API_KEY, else, on a server reachable from
    other machines, a new one. Beyond loopback this says so on stderr, with the addresses and
    the key when it was generated."""
    if given is not None and not given.strip():
        raise UserError("--api-key is empty; pass the key clients must send, or leave the option out.")
    key = given or os.environ.get(KEY_ENV) or None
    if is_loopback(host):
        return key
    if key is None:
        key = secrets.token_urlsafe(24)
        print(f"API key for this run (send 'Authorization: Bearer KEY' to /v1): {key}", file=sys.stderr)
    where = ", ".join(f"http://{_bracketed(a)}:{port}" for a in addresses(host)) or f"{host}:{port}"
    print(
        f"warning: medusa-chat is reachable from other machines at {where}; the chat page has no password "
        "(anyone who reaches it reads your chats), the API requires the key.",
        file=sys.stderr,
        flush=True,
    )
    return key


def addresses(host: str) -> list[str]:
    """The addresses other machines reach a server bound to `host` at (the machine's own, when
    bound to every interface), loopback left out."""
    if host not in EVERY_INTERFACE:
        return [host]
    found: list[str] = []
    # connecting a UDP socket sends nothing: it only picks the interface of the default route
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        found.append(s.getsockname()[0])
    with contextlib.suppress(OSError):
        found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)]
    if host != "::":
        found = [a for a in found if ":" not in a]
    return [a for a in dict.fromkeys(found) if not is_loopback(a)]
