"""The chat app, running for real on the embedded model: API end to end, kill/restart, browser."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gradio_client import Client
from playwright.sync_api import sync_playwright

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
