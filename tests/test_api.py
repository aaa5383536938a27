"""The OpenAI-compatible API: request checks without a model, then the real server on the embedded model.

The server runs in float32, where tree decoding at temperature 0 gives exactly the tokens of
plain decoding, so the API's replies must equal `medusa-chat generate --json` token for token.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app import api
from app.engine import Engine
from core.decode.generate import Finished
from core.drafters.registry import DRAFTERS
from models.embedded import EMBEDDED_ID

SYSTEM = "You answer in one short line."
PROMPT = "Name three colors."
OTHER = "What is the capital of France?"
MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def messages(prompt: str = PROMPT) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> str:
    """The response is an OpenAI error object with this status; its one-sentence message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert error["message"].endswith(".") and "Traceback" not in error["message"]
    if param:
        assert error["param"] == param
    if code:
        assert error["code"] == code
    return error["message"]


# ---- request checks, no model loaded (fast) ----


@pytest.fixture(scope="module")
def unloaded():
    app = FastAPI()
    app.include_router(api.router(Engine(EMBEDDED_ID)))  # never started: the model is "still loading"
    return TestClient(app)


def post(client: TestClient, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": EMBEDDED_ID, "messages": messages()} | body)


def test_models_lists_the_loaded_model(unloaded):
    data = unloaded.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [EMBEDDED_ID]


def test_a_malformed_body_is_an_error_object(unloaded):
    url = "/v1/chat/completions"
    typed = {"Content-Type": "application/json"}
    assert "not valid JSON" in assert_error(
        unloaded.post(url, content=b"{nope", headers=typed), 400, code="invalid_json"
    )
    assert_error(unloaded.post(url, json=[1, 2]), 400, code="invalid_body")
    assert_error(unloaded.post(url, json={"model": EMBEDDED_ID}), 400, "messages")
    assert_error(post(unloaded, messages=[{"role": "user", "content": {"x": 1}}]), 400, "messages[0].content")
    assert_error(post(unloaded, messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].role")
    assert_error(post(unloaded, messages=[{"role": "assistant", "content": "Hi"}]), 400, "messages")


def test_an_unknown_model_is_404(unloaded):
    message = assert_error(post(unloaded, model="gpt-4o"), 404, "model", "model_not_found")
    assert EMBEDDED_ID in message  # names the one to use


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("temperature", -1, "Temperature must be"),
        ("temperature", "hot", "finite number"),
        ("top_p", 0, "top-p must be in (0, 1]"),
        ("max_tokens", 0, "max new tokens must be at least 1"),
        ("max_completion_tokens", 2.5, "whole number"),
        ("epsilon", 1.5, "ε"),
        ("acceptance", "greedy", "lossless, typical"),
        ("mode", "fast", "medusa, baseline"),
        ("drafter", "oracle", "medusa, lookup, retrieval, hybrid, eagle"),
        ("stop", [""], "must not be empty"),
        ("n", 2, "not supported"),
        ("n", True, "not supported"),
        ("seed", 10**30, "2**64 - 1"),
    ],
)
def test_bad_settings_name_the_field(unloaded, field, value, words):
    message = assert_error(post(unloaded, **{field: value}), 400, field)
    assert words in message


def test_a_model_still_loading_is_503(unloaded):
    message = assert_error(post(unloaded), 503, code="model_not_ready")
    assert "still loading" in message


# ---- the real server on the embedded model (marker `embedded`) ----


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from app.server import start

    home = tmp_path_factory.mktemp("api")
    with pytest.MonkeyPatch.context() as mp:  # chats and settings of the chat page go here
        mp.setenv("XDG_DATA_HOME", str(home / "data"))
        mp.setenv("XDG_CONFIG_HOME", str(home / "config"))
        engine = Engine(EMBEDDED_ID, dtype="float32")
        engine.start()
        running = start(engine, "127.0.0.1", free_port())
        deadline = time.time() + 300
        while engine.loaded is None and time.time() < deadline:
            assert engine.error is None, engine.error
            time.sleep(0.5)
        assert engine.loaded is not None, "the model did not load"
        yield running
        running.close()


@pytest.fixture(scope="module")
def cli_reply() -> dict:
    """`medusa-chat generate --json` with the same settings, run in this process."""
    from app.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["generate", "--json", "--prompt", PROMPT, "--system", SYSTEM, "--dtype", "float32",
                     "--max-new-tokens", str(MAX_TOKENS), "--temperature", "0"])  # fmt: skip
    assert code == 0
    return json.loads(out.getvalue())["samples"][0]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0, timeout=300)


def stream_text(server, prompt: str = PROMPT, **extra) -> tuple[str, list]:
    chunks = list(
        client(server).chat.completions.create(
            model=EMBEDDED_ID, messages=messages(prompt), max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
    )  # fmt: skip
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


@pytest.mark.embedded
def test_the_openai_client_streams_the_cli_reply_with_the_figures(server, cli_reply):
    text, chunks = stream_text(server, acceptance="lossless", tree="auto")
    assert text == cli_reply["text"] and text.strip()
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed step by step
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(cli_reply["token_ids"])
    m = finish[0].model_extra["medusa"]
    assert m["tokens"] == len(cli_reply["token_ids"]) and m["steps"] == len(m["accepted_per_step"]) >= 1
    assert m["tokens_per_step"] == pytest.approx(m["tokens"] / m["steps"])
    assert m["accepted_per_step"][0] == 0 and all(a >= 0 for a in m["accepted_per_step"])
    assert m["tokens"] <= m["steps"] + sum(m["accepted_per_step"])  # each step: its accepted drafts and one more
    decode = m["accepted_per_step"][1:]
    assert m["mean_accepted_per_step"] == pytest.approx(sum(decode) / len(decode) if decode else 0.0)
    assert m["tokens_per_second"] > 0 and m["mode"] == "medusa" and m["tree"] == "auto"
    assert m["drafter"] in DRAFTERS and m["acceptance"] == "lossless"


@pytest.mark.embedded
def test_a_whole_plain_reply_is_the_same_text(server, cli_reply):
    reply = client(server).chat.completions.create(
        model=EMBEDDED_ID, messages=messages(), max_completion_tokens=MAX_TOKENS, extra_body={"mode": "baseline"}
    )
    assert reply.choices[0].message.content == cli_reply["text"]
    assert reply.usage.completion_tokens == len(cli_reply["token_ids"])
    m = reply.model_extra["medusa"]
    assert m["tree"] is None and m["drafter"] is None and m["tokens_per_step"] == 1.0
    assert set(m["accepted_per_step"]) == {0}


@pytest.mark.embedded
def test_a_stop_string_ends_the_reply_before_it_streamed_or_whole(server, cli_reply):
    reference = cli_reply["text"]
    stop = reference[len(reference) // 2 :][:3]
    expected = reference[: reference.find(stop)]
    assert stop.strip() and expected.strip()
    streamed, _ = stream_text(server, stop=[stop])
    assert streamed == expected  # nothing of the stop string leaked in a chunk
    whole = client(server).chat.completions.create(
        model=EMBEDDED_ID, messages=messages(), max_tokens=MAX_TOKENS, stop=stop
    )
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == "stop"


@pytest.mark.embedded
def test_errors_from_the_running_server(server):
    url = f"{server.url}/v1/chat/completions"
    typed = {"Content-Type": "application/json"}
    assert_error(httpx.post(url, content=b'{"model": ', headers=typed, timeout=60), 400, code="invalid_json")
    with pytest.raises(openai.NotFoundError) as lost:
        client(server).chat.completions.create(model="no-such-model", messages=messages())
    assert lost.value.status_code == 404 and lost.value.body["code"] == "model_not_found"
    long = httpx.post(url, json={"model": EMBEDDED_ID, "messages": messages("word " * 10_000)}, timeout=120)
    message = assert_error(long, 400, "messages", "context_length_exceeded")
    assert "shorten it" in message
    with pytest.raises(openai.BadRequestError, match="Temperature must be"):
        client(server).chat.completions.create(model=EMBEDDED_ID, messages=messages(), temperature=-1)


@pytest.mark.embedded
def test_concurrent_requests_and_a_chat_turn_run_one_after_another(server, cli_reply, monkeypatch):
    """Two API requests and a chat turn at once: all answered in full, one reply at a time, on one thread."""
    from gradio_client import Client

    import app.engine

    other_reference = client(server).chat.completions.create(
        model=EMBEDDED_ID, messages=messages(OTHER), max_tokens=MAX_TOKENS
    )
    runs: list[tuple[int, float, float]] = []  # (thread, start, end) of every reply's decoding
    real_stream = app.engine.stream

    def spy(*args, **kwargs):
        start = time.perf_counter()
        for event in real_stream(*args, **kwargs):
            if isinstance(event, Finished):  # recorded before anyone can see the reply finished
                runs.append((threading.get_ident(), start, time.perf_counter()))
            yield event

    monkeypatch.setattr(app.engine, "stream", spy)
    chat = Client(f"{server.url}/", verbose=False)
    results: dict[str, object] = {}

    def streamed():
        results["streamed"] = stream_text(server)[0]

    def whole():
        reply = client(server).chat.completions.create(model=EMBEDDED_ID, messages=messages(OTHER), max_tokens=24)
        results["whole"] = reply.choices[0].message.content

    def turn():
        # message, system, decoding, acceptance, ε, δ, temperature, top-p, max new tokens, tree, drafter, colors
        results["chat"] = chat.predict("Say hi.", "", "Medusa", "Lossless", 0.09, 0.3, 0.0, 1.0, 16, "auto", "", True,
                                       api_name="/send")  # fmt: skip

    threads = [threading.Thread(target=f) for f in (streamed, whole, turn)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results["streamed"] == cli_reply["text"]
    assert results["whole"] == other_reference.choices[0].message.content
    assert "data-step=" in json.dumps(results["chat"][0][-1]["content"])
    assert len(runs) == 3 and len({thread for thread, _, _ in runs}) == 1  # all on the one compute thread
    runs.sort(key=lambda r: r[1])
    assert all(later[1] >= earlier[2] for earlier, later in itertools.pairwise(runs)), runs


@pytest.mark.embedded
def test_a_client_that_leaves_mid_stream_ends_its_reply(server, monkeypatch):
    import app.engine

    finished: list[Finished] = []
    real_stream = app.engine.stream

    def spy(*args, **kwargs):
        for event in real_stream(*args, **kwargs):
            if isinstance(event, Finished):
                finished.append(event)
            yield event

    monkeypatch.setattr(app.engine, "stream", spy)
    body = {"model": EMBEDDED_ID, "messages": messages("Write a very long story about a lighthouse."),
            "max_tokens": 1500, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as response:
        for seen, _ in enumerate(response.iter_lines()):
            if seen == 8:
                break
    deadline = time.time() + 60
    while not finished and time.time() < deadline:
        time.sleep(0.1)
    assert finished and finished[0].finish_reason == "cancelled" and len(finished[0].token_ids) < 1500


@pytest.mark.embedded
def test_ctrl_c_stops_the_chat_command(tmp_path):
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.main", "ui", "--no-browser", "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 120
        while True:  # the API answers before the model has loaded
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=30).status_code == 200  # the chat page, same port
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and out == ""
    assert f"running at http://127.0.0.1:{port}" in err and err.rstrip().endswith("medusa-chat stopped.")


# ---- the draft model: the `draft_model` field and the "draft" drafter (tiny model folders, fast) ----


@pytest.mark.parametrize(("value", "code"), [(1, "invalid_type"), (["x"], "invalid_type"), (False, "invalid_type"),
                                             ("x" * 2000, "invalid_value")])  # fmt: skip
def test_a_draft_model_that_is_not_a_name_is_400(unloaded, value, code):
    message = assert_error(post(unloaded, draft_model=value), 400, "draft_model", code)
    assert "'draft_model' must be" in message and len(message) < 200  # the value is not echoed whole


@pytest.fixture(scope="module")
def tiny_api(tmp_path_factory):
    from types import SimpleNamespace

    from tests.test_engine import draft_folders, tiny_engine

    folders = draft_folders(tmp_path_factory.mktemp("api-draft"))
    with tiny_engine(folders.target) as engine:
        app = FastAPI()
        app.include_router(api.router(engine))
        yield SimpleNamespace(client=TestClient(app), engine=engine, folders=folders)


def test_the_draft_model_field_switches_the_engines_and_a_bad_one_keeps_it(tiny_api):
    from core.drafters.draft_model import MISSING

    engine, folders = tiny_api.engine, tiny_api.folders

    def ask(**extra) -> httpx.Response:
        body = {"model": folders.target, "messages": [{"role": "user", "content": "the cat sat on the mat"}],
                "max_tokens": 24, "temperature": 0}  # fmt: skip
        return tiny_api.client.post("/v1/chat/completions", json=body | extra)

    plain = ask(mode="baseline").json()
    assert plain["medusa"]["draft_model"] is None
    assert assert_error(ask(drafter="draft"), 400, code="invalid_value") == MISSING
    drafted = ask(draft_model=folders.draft, drafter="draft", tree="cpu-8")
    assert drafted.status_code == 200, drafted.text
    medusa = drafted.json()["medusa"]
    assert medusa["draft_model"] == folders.draft and medusa["drafter"] == "draft"
    assert drafted.json()["choices"][0]["message"] == plain["choices"][0]["message"]  # greedy: the plain reply
    assert engine.draft_model == folders.draft
    assert ask().json()["medusa"]["draft_model"] == folders.draft  # a request without the field keeps it
    for bad, words in ((folders.other, "another vocabulary"), (folders.missing, "Unknown model")):
        message = assert_error(ask(draft_model=bad), 400, "draft_model", "invalid_value")
        assert words in message and "\n" not in message
        assert engine.draft_model == folders.draft  # the one loaded before stays
    unloaded = ask(draft_model=None, mode="baseline")  # null: no draft model
    assert unloaded.status_code == 200 and unloaded.json()["medusa"]["draft_model"] is None
    assert engine.draft_model is None
    assert assert_error(ask(drafter="draft"), 400) == MISSING
