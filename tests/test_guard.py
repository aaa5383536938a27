"""The server's guard: only this server's own host names and page reach the chat and the API.

A real server (uvicorn on a free loopback port) on a tiny random model with a byte tokenizer,
and a planted chat whose title and message no other site may read: requests addressed to a
foreign host name (DNS rebinding), from a foreign origin (another site, another localhost
port, a real Chromium page), with a non-JSON or oversize body, are refused; a reply whose
client left stops at its next step, so the next request starts at once.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import app.engine
from app import api, guard, store
from app.engine import Engine, Loaded
from core.decode.generate import Finished
from core.errors import UserError
from models.loader import Backbone
from tests.helpers import tiny_model
from tests.test_api import assert_error, free_port

MODEL = "tiny"
TITLE = "Planted title 7Q4"
SECRET = "my password is hunter2-7Q4"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class ByteTokenizer:
    """Printable ASCII, one token per character (the tiny model's vocabulary is 96)."""

    chat_template = None
    pad_token_id = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) - 32 for c in text if 32 <= ord(c) < 128] or [0]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i) for i in ids)


def tiny_engine(context: int) -> Engine:
    """An engine whose model has loaded: a random tiny llama reading `context` positions, no end token."""
    engine = Engine(MODEL)
    model = tiny_model("llama")
    model.config.max_position_embeddings = context  # rotary positions are computed, not tabled
    engine.loaded = Loaded(Backbone(MODEL, model, ByteTokenizer(), ()), None, True, "cpu-8", None)
    return engine


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The real server on a free loopback port, with one saved chat holding a secret."""
    from app.server import start

    home = tmp_path_factory.mktemp("guard")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(home / "data"))
        mp.setenv("XDG_CONFIG_HOME", str(home / "config"))
        chat = store.Chat.new(MODEL)
        chat.title, chat.turns = TITLE, [store.Turn(SECRET, "Noted.", finished=True)]
        store.save_chat(chat)
        engine = tiny_engine(1 << 20)  # a reply that nobody stops runs for hours
        port = free_port()
        running = start(engine, "127.0.0.1", port)
        yield SimpleNamespace(url=running.url, port=port, chat_id=chat.id, engine=engine)
        running.close()


def body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "mode": "baseline"} | extra


def call_open_chat(served, headers: dict) -> httpx.Response | str:
    """Gradio's `open_chat` event through its HTTP API: the refusal, or the whole SSE answer."""
    url = f"{served.url}/gradio_api/call/open_chat"
    started = httpx.post(url, json={"data": [served.chat_id, True]}, headers=headers, timeout=30)
    if started.status_code != 200:
        return started
    answer = httpx.get(f"{url}/{started.json()['event_id']}", headers=headers, timeout=30)
    return answer.text


# ---- host and origin ----


def test_the_own_page_lists_and_opens_the_chat(served):
    """The control: addressed as 127.0.0.1 (or localhost) from its own page, everything answers."""
    for name in ("127.0.0.1", "localhost"):
        page = httpx.get(f"{served.url}/config", headers={"Host": f"{name}:{served.port}"}, timeout=30)
        assert page.status_code == 200 and TITLE in page.text
    own = {"Origin": f"http://localhost:{served.port}"}
    assert TITLE in httpx.get(f"{served.url}/config", headers=own, timeout=30).text
    assert httpx.get(f"{served.url}/", headers=own, timeout=30).status_code == 200
    assert SECRET in call_open_chat(served, {})


@pytest.mark.parametrize("host", ["evil.example:{port}", "127.0.0.1.evil.example:{port}", "localhost", "127.0.0.1:1"])
def test_a_foreign_host_name_cannot_list_or_open_a_chat(served, host):
    """DNS rebinding: a page at evil.example:PORT whose name resolves to 127.0.0.1 (and a Host
    without this server's port, which is not how a browser addresses it)."""
    headers = {"Host": host.format(port=served.port)}
    listed = httpx.get(f"{served.url}/config", headers=headers, timeout=30)
    assert listed.status_code == 403 and TITLE not in listed.text
    assert "refused" in listed.json()["error"]["message"]
    opened = call_open_chat(served, headers)
    assert isinstance(opened, httpx.Response) and opened.status_code == 403 and SECRET not in opened.text
    assert httpx.get(f"{served.url}/", headers=headers, timeout=30).status_code == 403
    assert httpx.get(f"{served.url}/v1/models", headers=headers, timeout=30).status_code == 403


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://evil.example", "null", "https://127.0.0.1"])
def test_another_sites_page_gets_no_chat_and_no_cors(served, origin):
    headers = {"Origin": origin}
    listed = httpx.get(f"{served.url}/config", headers=headers, timeout=30)
    assert listed.status_code == 403 and TITLE not in listed.text
    assert "access-control-allow-origin" not in listed.headers
    opened = call_open_chat(served, headers)
    assert isinstance(opened, httpx.Response) and opened.status_code == 403
    preflight = httpx.options(
        f"{served.url}/gradio_api/queue/join",
        headers=headers | {"Access-Control-Request-Method": "POST"},
        timeout=30,
    )
    assert "access-control-allow-origin" not in preflight.headers
    refused = httpx.post(f"{served.url}/v1/chat/completions", json=body(max_tokens=4), headers=headers, timeout=30)
    assert_error(refused, 403)


# ---- /v1 bodies ----


def test_only_json_bodies_reach_the_api(served):
    url = f"{served.url}/v1/chat/completions"
    raw = json.dumps(body(max_tokens=4))
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": kind} if kind else {}
        message = assert_error(httpx.post(url, content=raw, headers=headers, timeout=30), 415)
        assert "application/json" in message
    ok = httpx.post(url, content=raw, headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_an_oversize_body_is_refused_before_it_is_read(served):
    """A 60 MB Content-Length: refused at once, with the body never sent (today: waited for)."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{served.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {60 * 1024 * 1024}\r\n\r\n{{".encode()
        )
        answer = b""
        while chunk := s.recv(65536):  # the server closes; a timeout here (10 s) fails the test
            answer += chunk
    answer = answer.decode()
    assert answer.startswith("HTTP/1.1 413") and "over 4 MB" in answer


def test_a_streamed_oversize_body_is_read_no_further_than_the_limit():
    """Without a Content-Length (chunked), reading stops at the first chunk past the limit."""
    chunk = b" " * (1 << 20)
    read, sent = [0], []

    async def receive():
        read[0] += 1
        return {"type": "http.request", "body": chunk, "more_body": read[0] < 60}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        raise AssertionError("the app saw an oversize body")

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")]}  # fmt: skip
    asyncio.run(guard.Guard(app, guard.policy("127.0.0.1", 8000))(scope, receive, send))
    assert sent[0]["status"] == 413 and read[0] == guard.MAX_BODY // len(chunk) + 1


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "nested too deeply"),
        (json.dumps(body(messages=[{"role": "user", "content": "\ud800"}])).encode(), "lone surrogate"),
        (json.dumps(body(stop="\udfff")).encode(), "lone surrogate"),
    ],
)
def test_deep_nesting_and_lone_surrogates_are_one_sentence_400s(served, raw, words):
    url = f"{served.url}/v1/chat/completions"
    response = httpx.post(url, content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert words in assert_error(response, 400)


def test_values_the_api_cannot_honour_are_400s(served):
    url = f"{served.url}/v1/chat/completions"
    assert_error(httpx.post(url, json=body(n=True), timeout=30), 400, "n")
    for seed in (10**30, -(2**63) - 1, 2**64):
        assert_error(httpx.post(url, json=body(seed=seed, max_tokens=2), timeout=30), 400, "seed")
    for seed in (2**64 - 1, -1):  # torch's whole range
        assert httpx.post(url, json=body(seed=seed, max_tokens=2), timeout=30).status_code == 200
    huge = "m" * 100_000
    message = assert_error(httpx.post(url, json=body(model=huge), timeout=30), 404, "model")
    assert len(message) < 300
    message = assert_error(httpx.post(url, json=body(tree=huge, mode="medusa"), timeout=30), 400, "tree")
    assert len(message) < 300


def _api_app(engine: Engine) -> guard.Guard:
    app = FastAPI()
    app.include_router(api.router(engine))
    return guard.Guard(app, guard.policy("127.0.0.1", 8000))


def test_max_tokens_is_capped_by_the_context():
    """A limit far past the context ends the reply where the context ends."""
    engine = tiny_engine(64)
    client = TestClient(_api_app(engine), base_url="http://127.0.0.1:8000")
    reply = client.post("/v1/chat/completions", json=body(max_tokens=10**9)).json()
    usage = reply["usage"]
    assert reply["choices"][0]["finish_reason"] == "length" and usage["total_tokens"] == 64
    engine.close()


# ---- the API key ----


def test_the_api_key_is_required_when_set(served):
    from app.server import start

    keyed = start(Engine(MODEL), "127.0.0.1", free_port(), api_key="s3cret-key")
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"}):
            message = assert_error(httpx.get(f"{keyed.url}/v1/models", headers=headers), 401, code="invalid_api_key")
            assert "--api-key" in message and "s3cret" not in message
            refused = httpx.post(f"{keyed.url}/v1/chat/completions", json=body(), headers=headers, timeout=30)
            assert_error(refused, 401)
        for scheme in ("Bearer", "bearer"):
            headers = {"Authorization": f"{scheme} s3cret-key"}
            assert httpx.get(f"{keyed.url}/v1/models", headers=headers).status_code == 200
        assert httpx.get(f"{keyed.url}/config").status_code == 200  # the chat page is not the API
    finally:
        keyed.close()
    assert httpx.get(f"{served.url}/v1/models").status_code == 200  # no key set: none asked for


def test_a_key_is_generated_and_announced_beyond_loopback(capsys, monkeypatch):
    monkeypatch.delenv(guard.KEY_ENV, raising=False)
    assert guard.api_key("127.0.0.1", 7860, None) is None and capsys.readouterr().err == ""
    monkeypatch.setenv(guard.KEY_ENV, "from-env")
    assert guard.api_key("127.0.0.1", 7860, None) == "from-env"
    assert guard.api_key("127.0.0.1", 7860, "given") == "given"
    monkeypatch.delenv(guard.KEY_ENV)
    key = guard.api_key("0.0.0.0", 7860, None)
    err = capsys.readouterr().err
    assert key and len(key) >= 24 and err.count(key) == 1
    assert "reachable from other machines" in err and "requires the key" in err
    assert all(f"{a}:7860" in err for a in guard.addresses("0.0.0.0"))
    assert guard.api_key("192.168.1.5", 7860, "mine") == "mine"
    err = capsys.readouterr().err
    assert "http://192.168.1.5:7860" in err and "mine" not in err
    with pytest.raises(UserError, match="--api-key is empty"):
        guard.api_key("127.0.0.1", 7860, " ")


def test_on_every_interface_addresses_pass_and_names_do_not():
    p = guard.policy("0.0.0.0", 7860, "k")
    assert all(guard.host_allowed(p, h) for h in ("192.168.1.5:7860", "[fe80::1]:7860", "localhost:7860"))
    assert not any(guard.host_allowed(p, h) for h in ("evil.example:7860", "192.168.1.5:80", "192.168.1.5"))
    own = guard.policy("192.168.1.5", 7860)
    assert guard.host_allowed(own, "192.168.1.5:7860") and not guard.host_allowed(own, "192.168.1.6:7860")
    assert guard.refusal(own, {"host": "192.168.1.5:7860", "origin": "http://192.168.1.5:7860"}) is None
    assert guard.refusal(own, {"host": "192.168.1.5:7860", "origin": "http://192.168.1.5:8080"}) is not None


# ---- a client that leaves ----


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_frees_the_queue_at_once(served, monkeypatch, stream):
    """max_tokens 10**9 (capped only by a context of 2**20): the client goes away mid-reply, and
    the next request's reply starts within 1 s."""
    runs: list[dict] = []
    real_stream = app.engine.stream

    def spy(*args, **kwargs):
        run = {"start": time.monotonic()}
        runs.append(run)
        for event in real_stream(*args, **kwargs):
            if isinstance(event, Finished):
                run["finished"] = event
            yield event

    monkeypatch.setattr(app.engine, "stream", spy)
    raw = json.dumps(body(max_tokens=10**9, stream=stream))
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{served.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n{raw}".encode()
        )
        deadline = time.monotonic() + 30
        while not runs and time.monotonic() < deadline:
            time.sleep(0.02)
        assert runs, "the reply did not start"
        time.sleep(0.5)  # some steps into the reply
        s.shutdown(socket.SHUT_RDWR)
    left = time.monotonic()
    after = httpx.post(f"{served.url}/v1/chat/completions", json=body(max_tokens=3), timeout=60)
    assert after.status_code == 200, after.text
    assert len(runs) == 2 and runs[0]["finished"].finish_reason == "cancelled"
    assert runs[1]["start"] - left < 1.0


# ---- a real browser on another localhost port ----

PAGE = """<!doctype html><title>another site</title><script>
window.results = {};
async function attempt(name, url, options) {
  try {
    const r = await fetch(url, options);
    window.results[name] = r.status + " " + await r.text();
  } catch (e) {
    window.results[name] = "failed: " + e;
  }
}
(async () => {
  const app = "http://127.0.0.1:APP_PORT";
  const body = JSON.stringify({model: "tiny", mode: "baseline", max_tokens: 5,
                               messages: [{role: "user", content: "Hello"}]});
  await attempt("config", app + "/config", {credentials: "include"});
  await attempt("cors", app + "/v1/chat/completions", {method: "POST", body, headers: {"Content-Type": "text/plain"}});
  await attempt("no-cors", app + "/v1/chat/completions", {method: "POST", body, mode: "no-cors"});
  await attempt("open", app + "/gradio_api/call/open_chat",
                {method: "POST", body: JSON.stringify({data: ["CHAT_ID", true]}),
                 headers: {"Content-Type": "application/json"}});
  window.done = true;
})();
</script>"""


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)")
def test_a_page_on_another_localhost_port_reads_no_chat(served, tmp_path, monkeypatch):
    from playwright.sync_api import sync_playwright

    from tests.test_ui import BROWSER_ARGS

    replies: list[float] = []
    real_stream = app.engine.stream

    def spy(*args, **kwargs):
        replies.append(time.monotonic())
        yield from real_stream(*args, **kwargs)

    monkeypatch.setattr(app.engine, "stream", spy)
    page_text = PAGE.replace("APP_PORT", str(served.port)).replace("CHAT_ID", served.chat_id)
    (tmp_path / "index.html").write_text(page_text)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            page = browser.new_page()
            own = page.goto(served.url + "/")  # the control: the app's own page reads its chat list
            assert own.status == 200 and TITLE in page.evaluate("fetch('/config').then(r => r.text())")
            page.goto(f"http://localhost:{other.server_address[1]}/index.html")
            page.wait_for_function("window.done === true", timeout=60_000)
            results = page.evaluate("window.results")
            browser.close()
    finally:
        other.shutdown()
    assert set(results) == {"config", "cors", "no-cors", "open"}
    for name, text in results.items():
        assert TITLE not in text and SECRET not in text and "event_id" not in text, (name, text)
    time.sleep(0.5)
    assert replies == []  # the model did no work for the other site
