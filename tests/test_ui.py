"""The chat app, running for real on the embedded model: API end to end, kill/restart, browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from gradio_client import Client
from playwright.sync_api import sync_playwright

from app import ui
from app.engine import Engine, Reply
from core.decode.generate import Finished, StepEvent
from core.errors import UserError
from models import catalog

pytestmark = pytest.mark.embedded
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-quic"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class App:
    """`medusa-chat ui` in a subprocess with its own data and config folders."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {**os.environ, "XDG_DATA_HOME": str(home / "data"), "XDG_CONFIG_HOME": str(home / "config")}
        self.log = open(home / f"app-{self.port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.main", "ui", "--no-browser", "--port", str(self.port)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def client(self) -> Client:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert self.proc.poll() is None, (self.home / f"app-{self.port}.log").read_text()
            try:
                client = Client(self.url, verbose=False)
                status = client.predict(api_name="/status")[0]
                if "Ready:" in status:
                    return client
                assert "Problem:" not in status, status
            except Exception:  # not up yet: connection refused, page not served, …
                pass
            time.sleep(1)
        raise TimeoutError("the app did not become ready")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def send_args(message: str, max_new_tokens: int = 64, drafter: str = "") -> tuple:
    # message, system, decoding, acceptance, ε, δ, temperature, top-p, max new tokens, tree, drafter, colors
    return (message, "", "Medusa", "Lossless", 0.09, 0.3, 0.0, 1.0, max_new_tokens, "(model default)", drafter, True)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    running = App(tmp_path_factory.mktemp("app"))
    yield running
    running.stop()


def test_send_streams_a_colored_answer_with_stats(app):
    client = app.client()
    job = client.submit(*send_args("Write three sentences about the sea."), api_name="/send")
    updates = [out for out in job]
    chat, _msg, stats = job.outputs()[-1][:3]
    assert len(updates) >= 3  # streamed step by step
    assert chat[0]["role"] == "user" and chat[-1]["role"] == "assistant"
    answer = json.dumps(chat[-1]["content"])
    assert "data-step=" in answer and "data-accepted=" in answer
    for label in ("tokens / step", "tokens / s", "first token", "Acceptance rate by tree depth", "drafter"):
        assert label in stats


def test_hybrid_drafter_marks_what_was_copied_from_the_conversation(app):
    client = app.client()
    prompt = "Repeat this list exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa."
    chat, _msg, stats, *_ = client.predict(*send_args(prompt, 48, "hybrid"), api_name="/send")
    answer = json.dumps(chat[-1]["content"])
    assert 'data-source=\\"context\\"' in answer or 'data-source=\\"both\\"' in answer, answer
    assert "copied from the conversation" in stats and "hybrid" in stats


def test_compare_inspector_regenerate_rename_export(app):
    client = app.client()
    client.predict(*send_args("Say hello in French.", 24), api_name="/send")
    controls = send_args("")[1:]
    comparison = client.predict(*controls, api_name="/compare")
    assert "Plain" in comparison and "speedup" in comparison
    tree = client.predict(2, api_name="/inspect")
    assert "candidates verified" in tree and 'class="node accepted' in tree
    chat, _msg, stats, *_ = client.predict(*controls, api_name="/regenerate")
    assert len([m for m in chat if m["role"] == "assistant"]) == 1 and "tokens / step" in stats
    choices = client.predict("Greetings", api_name="/rename")
    assert "Greetings" in json.dumps(choices)
    exported = Path(client.predict(api_name="/export")).read_text()
    assert exported.startswith("# Greetings") and "Say hello in French." in exported


def test_stop_keeps_the_partial_answer(app):
    client = app.client()
    job = client.submit(*send_args("Write a very long story about a lighthouse keeper.", 2048), api_name="/send")
    for seen, _ in enumerate(job, 1):
        if seen == 8:
            client.predict(api_name="/stop")
            break
    deadline = time.time() + 60
    while not job.done() and time.time() < deadline:
        time.sleep(0.2)
    assert job.done()
    chat, _msg, stats = job.outputs()[-1][:3]
    assert "cancelled" in stats
    assert "data-step=" in json.dumps(chat[-1]["content"])


def test_a_killed_app_loses_no_finished_turn(tmp_path):
    first = App(tmp_path)
    try:
        client = first.client()
        client.predict(*send_args("Name a color.", 24), api_name="/send")
        job = client.submit(*send_args("Write a very long poem about rivers.", 2048), api_name="/send")
        for i, _ in enumerate(job):
            if i == 5:
                break
        first.kill()  # mid-generation, no chance to clean up
    finally:
        first.stop()
    files = list((tmp_path / "data" / "medusa-chat" / "chats").glob("*"))
    assert [f.suffix for f in files] == [".json"]  # no half-written or temporary file
    chat = json.loads(files[0].read_text())
    assert chat["turns"][0]["user"] == "Name a color." and chat["turns"][0]["finished"]
    assert chat["turns"][0]["assistant"].strip()
    assert chat["turns"][1]["user"] == "Write a very long poem about rivers."  # saved before its reply started

    second = App(tmp_path)
    try:
        client = second.client()
        reopened = client.predict(chat["id"], True, api_name="/open_chat")[0]
        assert reopened[0]["content"] == "Name a color." or "Name a color." in json.dumps(reopened[0])
        assert "data-step=" in json.dumps(reopened[1]["content"])
    finally:
        second.stop()


def damaged_chat(home: Path) -> Path:
    chats = home / "data" / "medusa-chat" / "chats"
    chats.mkdir(parents=True)
    (chats / "broken.json").write_text('{"id": "broken", "turns": [')
    return chats


def test_a_damaged_chat_file_is_set_aside(tmp_path):
    chats = damaged_chat(tmp_path)
    app = App(tmp_path)
    try:
        app.client()
    finally:
        app.stop()
    assert (chats / "broken.corrupt").exists() and not (chats / "broken.json").exists()


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)")
def test_the_user_is_told_about_a_damaged_chat_file(tmp_path):
    damaged_chat(tmp_path)
    app = App(tmp_path)
    try:
        app.client()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            page = browser.new_page()
            page.goto(app.url)
            page.get_by_text("A damaged chat file was set aside as broken.corrupt.").wait_for(timeout=30_000)
            browser.close()
    finally:
        app.stop()


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)")
def test_real_browser_shows_step_markers_and_typical_controls(app, tmp_path):
    app.client()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(app.url)
        page.locator("#msg textarea").fill("Give me a short list of three fruits.")
        page.locator("#send").click()
        page.wait_for_selector("#chat [data-step]", timeout=120_000)
        page.wait_for_function("!document.querySelector('#chat .cursor')", timeout=120_000)
        markers = page.locator("#chat [data-step]")
        assert markers.count() > 3
        assert markers.first.get_attribute("data-accepted") is not None
        assert page.locator("#stats").inner_text().count("tokens") >= 2

        assert page.locator("#epsilon input[type=range]").is_disabled()
        page.locator("#acceptance label", has_text="Typical").click()
        page.wait_for_function("!document.querySelector('#epsilon input[type=range]').disabled", timeout=10_000)
        page.locator("#epsilon input[type=number]").fill("0.2")
        page.locator("#epsilon input[type=number]").press("Enter")
        page.wait_for_function("document.querySelector('#epsilon input[type=range]').value === '0.2'", timeout=10_000)
        settings = app.home / "config" / "medusa-chat" / "settings.json"
        deadline = time.time() + 10
        while time.time() < deadline and '"epsilon": 0.2' not in (settings.read_text() if settings.exists() else ""):
            time.sleep(0.2)
        saved = json.loads(settings.read_text())
        assert saved["acceptance"] == "Typical" and saved["epsilon"] == 0.2 and saved["decoding"] == "Medusa"
        shot = tmp_path / "browser.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 10_000


# -- the draft model on the page: handlers called directly, around an engine that loads nothing --------------------

SUGGESTED = "example/small-draft"


class DraftEngine(Engine):
    """An Engine that never loads a model; its draft model is a name, and set_draft_model records its calls."""

    refusal = ""  # set: set_draft_model raises a UserError saying this

    @property
    def draft_model(self) -> str | None:
        return self.__dict__.get("_test_draft")

    @draft_model.setter
    def draft_model(self, name: str | None) -> None:
        self.__dict__["_test_draft"] = name

    def set_draft_model(self, name: str | None, on_progress=None) -> None:
        self.__dict__.setdefault("calls", []).append(name)
        if self.refusal:
            raise UserError(self.refusal)
        self.draft_model = None if name in (None, "none") else name


@pytest.fixture
def page(home, monkeypatch):
    """(the page, its handlers by name, the engine) with the catalog suggesting SUGGESTED as a draft model."""
    monkeypatch.setattr(catalog, "draft_for", lambda model_id: SUGGESTED, raising=False)
    engine = DraftEngine(catalog.entries()[0].id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradio: the model is not among the dropdown's choices
        demo = ui.build(engine)
    return demo, {f.name: f for f in demo.fns.values()}, engine


def _component(demo, elem_id: str):
    return next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == elem_id)


def test_the_draft_model_control_offers_none_self_and_the_catalogs_suggestion(page):
    demo, fns, _ = page
    control = _component(demo, "draft-model")
    assert control.label == "Draft model" and control.allow_custom_value and control.value == "none"
    values = [value for _, value in control.choices]
    assert values == ["none", "self", SUGGESTED]
    assert "self — this model in 4 bits (for full precision)" in [label for label, _ in control.choices]
    drafter = _component(demo, "drafter")
    assert ("Draft model + context + past replies", "draft") in drafter.choices  # from the registry's table
    change = fns["set_draft_model"]  # queued with replies and model switches: one model job at a time
    assert change.concurrency_id == fns["switch"].concurrency_id == "generate" and change.concurrency_limit == 1
    assert [t[1] for t in change.targets] == ["input"]  # the user's change only: putting it back loads nothing
    assert [o._id for o in change.outputs] == [
        control._id,
        _component(demo, "draft-info")._id,
        _component(demo, "status")._id,
    ]  # the chat, the message box and the settings are not among its outputs


def test_choosing_a_draft_model_loads_it_through_the_engine(page):
    _, fns, engine = page
    control, note, status = fns["set_draft_model"].fn(f"  {SUGGESTED} ")
    assert engine.calls == [SUGGESTED] and engine.draft_model == SUGGESTED
    assert control["value"] == SUGGESTED and "Draft model loaded" in note and "small\\-draft" in note
    assert status == engine.status()
    control, note, _ = fns["set_draft_model"].fn("./my <b>folder</b>")  # typed: any id or folder
    assert (
        engine.calls[-1] == "./my <b>folder</b>" and ("./my <b>folder</b>", "./my <b>folder</b>") in control["choices"]
    )
    assert "<b>" not in note and "\\<b\\>" in note  # a typed name is shown as text, not markup
    control, note, _ = fns["set_draft_model"].fn("none")
    assert engine.calls[-1] is None and control["value"] == "none" and note == ""


def test_a_refused_draft_model_says_why_and_puts_the_control_back(page):
    _, fns, engine = page
    fns["set_draft_model"].fn("self")
    engine.refusal = "The draft model must share the model's tokenizer."
    with pytest.warns(UserWarning, match="must share the model's tokenizer"):
        control, note, _ = fns["set_draft_model"].fn("gpt2")
    assert engine.calls == ["self", "gpt2"] and engine.draft_model == "self"
    assert control["value"] == "self" and "must share the model" in note


def test_the_line_under_the_control_suggests_a_draft_model_to_a_model_without_drafters(page):
    _, fns, engine = page
    assert fns["draft_state"].fn()[1] == ""  # still loading: nothing known yet
    engine.loaded = SimpleNamespace(trained=False, eagle=None)
    control, note = fns["draft_state"].fn()
    assert "no trained Medusa heads or EAGLE layer" in note and "small\\-draft" in note
    assert control["value"] == "none"
    engine.loaded = SimpleNamespace(trained=True, eagle=None)
    assert fns["draft_state"].fn()[1] == ""


def test_a_reply_drafted_by_the_draft_model_shows_its_style_and_count(page, monkeypatch):
    _, fns, engine = page
    steps = [
        StepEvent(1, (5,), "Hi ", 0, (0,), (), 0, 0.01, 100.0),
        StepEvent(2, (6, 7, 8), "<i>there</i>", 2, (0, 1, 2), (8, 6, 7), 3, 0.01, 100.0,
                  sources=("draft", "draft"), parents=(0, 0, 1), node_sources=("root", "draft", "draft")),
        Finished((5, 6, 7, 8), "Hi <i>there</i>", 2, 0.02, 0.01, "eos"),
    ]  # fmt: skip

    def reply(request, should_stop=None):
        return Reply([1, 2], "", 0, "auto", "draft", 3, iter(steps))

    monkeypatch.setattr(engine, "reply", reply)
    monkeypatch.setattr(engine, "token_text", lambda t: f"<{t}>")
    *_, (chat, session, _msg, stats, *_rest) = fns["send"].fn("hello", None, *send_args("")[1:])
    answer = chat[-1]["content"]
    assert 'src-draft" data-step="2" data-accepted="2" data-source="draft"' in answer
    assert "from the draft model" in answer and "&lt;i&gt;there&lt;/i&gt;" in answer and "<i>" not in answer
    assert "drafted: from the draft model</th><td>2 (50%)" in stats
    inspector = fns["inspect"].fn(2, session)
    assert inspector.count("<small>draft</small>") == 2 and "&lt;8&gt;" in inspector


def test_the_api_refuses_a_missing_draft_model_and_keeps_none(app, tmp_path):
    client = app.client()
    control, note, status = client.predict(str(tmp_path / "no-such-model"), api_name="/set_draft_model")
    shown = re.sub(r"\\(.)", r"\1", note)  # the line is Markdown with its punctuation escaped
    assert control["value"] == "none" and "no-such-model'" in shown, note  # the engine's sentence, under the control
    assert "Ready:" in status and "draft model" not in status
