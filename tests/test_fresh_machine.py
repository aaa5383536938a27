"""The command line as a new user meets it: empty cache, data and config folders."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.embedded


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("fresh")
    env = dict(os.environ)
    for var, sub in (("XDG_CACHE_HOME", "cache"), ("XDG_DATA_HOME", "data"), ("XDG_CONFIG_HOME", "config")):
        env[var] = str(home / sub)
    env["HF_HOME"] = str(home / "hf")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.main", *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_generate_json_parses_on_the_first_and_second_run(fresh_env):
    args = ("generate", "--json", "--prompt", "Name a color.", "--max-new-tokens", "8", "--dtype", "float32")
    first = run(fresh_env, *args)
    assert first.returncode == 0, first.stderr
    assert "Reading the tokenizer and config of the embedded model" in first.stderr  # the first run was a fresh one
    second = run(fresh_env, *args)
    assert second.returncode == 0, second.stderr
    assert "Converting" not in second.stderr
    one, two = json.loads(first.stdout), json.loads(second.stdout)
    assert one["samples"][0]["token_ids"] == two["samples"][0]["token_ids"]
    assert len(one["samples"][0]["token_ids"]) == 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ui_options_without_the_ui_command(fresh_env):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.main", "--no-browser", "--port", str(port)],
        env=fresh_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline, page = time.monotonic() + 180, ""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
                    page = response.read().decode()
                break
            except OSError:
                time.sleep(1)
        assert proc.poll() is None, proc.communicate()[1]
        assert "medusa-chat" in page
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    assert out == ""  # status lines go to stderr
    assert f"http://127.0.0.1:{port}" in err


def test_help_says_what_the_program_does_today(fresh_env):
    result = run(fresh_env, "--help")
    assert result.returncode == 0
    assert "later" not in result.stdout and "opens the chat" in result.stdout
    for command in ("ui", "generate", "bench", "models", "download", "train-heads", "calibrate"):
        assert command in result.stdout
