"""Starting up and failing to: the host and port checked before anything loads, one sentence per
cause and no abort, SIGTERM while the model loads, the ready line, outputs checked before the work,
and kernel choices that fall back when the kernel library cannot be had."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from app import listen
from core.errors import UserError

RUNS = 20  # each failing start, as often as it took to see the abort


def cli(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.main", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def one_sentence(result: subprocess.CompletedProcess, expected: str) -> None:
    """Exit status 2, one `error:` line naming the cause, nothing else alarming on stderr."""
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert "Traceback" not in result.stderr and "terminate called" not in result.stderr, result.stderr


# -- the host and port, before anything loads -----------------------------------------------------


def test_a_start_that_cannot_listen_is_one_sentence_every_time_and_never_an_abort():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = {
            "port out of range": (["--port", "99999"], "expected a port from 1 to 65535"),
            "port in use": (["--port", port], f"Port {port} is already in use"),
            "unknown host": (
                ["--host", "no-such-host.invalid", "--port", "8123"],
                "Unknown host 'no-such-host.invalid'",
            ),
        }
        for name, (args, expected) in cases.items():
            for _ in range(RUNS):
                result = cli("--no-browser", *args)
                one_sentence(result, expected)
                assert "Loading" not in result.stderr and "running at" not in result.stderr, (name, result.stderr)


def test_each_cause_of_not_listening_has_its_own_sentence():
    with pytest.raises(UserError, match="not an address of this machine"):
        listen.checked_port("192.0.2.1", 8123)  # TEST-NET-1: documentation only, never a local address
    denied = listen._sentence(OSError(errno.EACCES, "Permission denied"), "127.0.0.1", 80)
    assert "administrator rights" in str(denied) and "above 1023" in str(denied)
    other = listen._sentence(OSError(errno.ENOBUFS, "No buffer space available"), "127.0.0.1", 8123)
    assert "No buffer space available" in str(other)
    for bad in ("0", "65536", "-1", "http"):
        with pytest.raises(Exception, match="expected a port from 1 to 65535"):
            listen.port_number(bad)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert listen.why_not("127.0.0.1", taken.getsockname()[1]).startswith(f"Port {taken.getsockname()[1]}")
    assert listen.why_not("127.0.0.1", listen.checked_port("127.0.0.1", None)) is None


def test_a_server_that_fails_to_start_while_the_model_loads_ends_without_an_abort(monkeypatch, capsys):
    """The port taken between the check and the server's start: one sentence, exit 2, and the
    process ended at once rather than exiting under the loading thread (which aborts)."""
    from app.cli import ui

    class Loading:  # an engine whose first model never finishes loading
        loaded = error = None

        def __init__(self, *args: object) -> None:
            pass

        def start(self):
            from concurrent.futures import Future

            return Future()

        def close(self, timeout: float | None = None) -> bool:
            return False

    def start(*args: object) -> None:
        raise UserError("Port 8123 is already in use on 127.0.0.1; pass another --port, or none for the next free one.")

    exits = []
    fakes = {"app.engine": {"Engine": Loading}, "app.server": {"start": start}, "app.store": {"saved_replies": list}}
    for name, attributes in fakes.items():
        module = ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code) or sys.exit(code))
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setattr(ui.logging, "shutdown", lambda: None)  # pytest's own log handlers stay open
    args = SimpleNamespace(
        host="127.0.0.1", port=8123, api_key=None, no_past_replies=False, model="m", dtype="auto", device="auto",
        quantization="auto", heads=None, eagle=None, draft_model=None, no_browser=True, no_window=False,
    )  # fmt: skip
    with pytest.raises(SystemExit):
        ui.run(args)
    err = capsys.readouterr().err
    assert exits == [2] and err.count("error:") == 1 and "already in use" in err


# -- one sentence for outputs that cannot be written, before the work -------------------------------


def test_outputs_that_cannot_be_written_are_refused_before_the_work(tmp_path):
    blocker = tmp_path / "a-file"  # nothing can be created under a file, not even by root
    blocker.write_text("")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    cases = {
        "train-heads --out": (["train-heads", "--prompts", str(prompts), "--out", str(blocker / "heads")], "--out"),
        "train-drafter --out": (
            ["train-drafter", "--prompts", str(prompts), "--out", str(blocker / "c.safetensors")],
            "--out",
        ),
        "bench --json": (["bench", "--prompts", str(prompts), "--json", str(blocker / "r.json")], "--json"),
        "bench --json, a folder": (["bench", "--prompts", str(prompts), "--json", str(tmp_path)], "--json"),
        "calibrate --out": (["calibrate", "--out", str(blocker / "preset.json")], "--out"),
    }
    for name, (args, option) in cases.items():
        result = cli(*args)
        one_sentence(result, f"pass {option} a path you can write to")
        assert "Loading" not in result.stderr and "bench:" not in result.stderr, (name, result.stderr)
    env = {**os.environ, "XDG_DATA_HOME": str(blocker)}
    one_sentence(cli("install-desktop", env=env), "set XDG_DATA_HOME to a folder you can write to")


def test_a_seed_torch_cannot_take_is_one_sentence():
    one_sentence(cli("generate", "--prompt", "hi", "--seed", str(10**30)), "expected a seed from 0 to 2**64 - 1")
    one_sentence(cli("generate", "--prompt", "hi", "--seed", "-1"), "expected a seed")
    last = str(2**64 - 1)
    one_sentence(cli("generate", "--prompt", "hi", "--seed", last, "--num-samples", "2"), "pass a smaller --seed")


def test_writable_tries_the_path_and_leaves_it_as_it_was(tmp_path):
    from app.cli.options import writable

    existing = tmp_path / "keep.json"
    existing.write_text("as it was")
    assert writable(existing, "--json") == existing and existing.read_text() == "as it was"
    assert writable(tmp_path / "new" / "out", "--out", folder=True).is_dir()
    assert list((tmp_path / "new" / "out").iterdir()) == []  # the trial file is gone
    with pytest.raises(UserError, match="not a folder"):
        writable(existing, "--out", folder=True)


def test_a_bench_report_that_cannot_be_written_at_the_end_is_kept_elsewhere(tmp_path):
    from app.cli import bench

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UserError, match="the results are in") as caught:
        bench._save('{"summary": 1}\n', blocker / "r.json")
    kept = Path(str(caught.value).rsplit(" in ", 1)[1].removesuffix(" instead."))
    try:
        assert kept.read_text() == '{"summary": 1}\n'
    finally:
        kept.unlink()


# -- kernel choices that fall back for one load --------------------------------------------------


def test_a_remembered_library_kernel_falls_back_when_the_library_is_unavailable(tmp_path, monkeypatch):
    from core.backends import lean as fast
    from core.backends import q4
    from core.measure import kernels

    record = tmp_path / "cpu-kernels.json"
    key = kernels.record_key("64x128", "auto", "int4")
    remembered = {"dtype": "bfloat16", "kernel": "q4", "head_kernel": "q8"}
    draft_key = kernels.record_key(f"draft 4x64x{fast.padded_rows(96)}")
    record.write_text(json.dumps({key: remembered, draft_key: ["bfloat16", "q4"]}))
    monkeypatch.setattr(q4, "library", lambda: None)  # no compiler here now, say
    monkeypatch.setattr(q4, "unavailable", lambda: "no C compiler was found")

    fallback = kernels.choose(64, 128, None, True, record)
    assert fallback in kernels.candidates(None, True) and fallback.kernel not in fast.LIBRARY
    assert fallback.head_kernel not in fast.LIBRARY
    assert kernels.drafting(96, 64, 4, record)[1] not in fast.LIBRARY
    known = json.loads(record.read_text())
    assert known[key] == remembered and known[draft_key] == ["bfloat16", "q4"]  # kept for when it is back

    timed = []
    monkeypatch.setattr(kernels, "_seconds", lambda *a: timed.append(a))
    assert kernels.choose(64, 128, None, True, record) == fallback and timed == []  # the fallback is remembered too
    monkeypatch.setattr(q4, "library", lambda: object())  # the library is back: the remembered choice again
    assert kernels.choose(64, 128, None, True, record) == kernels.Choice(**remembered) and timed == []
    assert kernels.drafting(96, 64, 4, record) == ("bfloat16", "q4")


# -- with the embedded model ------------------------------------------------------------------------


@pytest.fixture
def fresh_cache(tmp_path) -> dict[str, str]:
    """An environment whose cache folder holds the converted embedded model and nothing else
    (no kernel library, no measurements), with chats and settings in tmp_path."""
    from models.embedded import EMBEDDED_ID, embedded_dir

    models = tmp_path / "cache" / "medusa-chat" / "models"
    models.mkdir(parents=True)
    (models / EMBEDDED_ID).symlink_to(embedded_dir())
    return {
        **os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
    }  # fmt: skip


@pytest.mark.embedded
def test_without_a_compiler_after_a_normal_first_launch_the_model_replies_on_fallback_kernels(fresh_cache, tmp_path):
    from tests.helpers import library_builds

    if not library_builds():
        pytest.skip("the kernel library cannot be built here, so no launch remembers its kernels")
    ask = ("generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "8", "--mode", "baseline")
    first = cli(*ask, env=fresh_cache, timeout=600)
    assert first.returncode == 0 and first.stdout.strip(), first.stderr
    file = tmp_path / "cache" / "medusa-chat" / "cpu-kernels.json"
    record = json.loads(file.read_text())
    (key,) = [k for k, c in record.items() if isinstance(c, dict)]  # the backbone's kernels, as measured
    record[key] = {"dtype": "bfloat16", "kernel": "q4", "head_kernel": "q8"}  # as where the library measured fastest
    file.write_text(json.dumps(record))
    kernels = tmp_path / "cache" / "medusa-chat" / "kernels"
    assert any(kernels.glob("*.so"))
    for built in kernels.iterdir():
        built.unlink()
    without = cli(*ask, env={**fresh_cache, "CC": "/bin/false"}, timeout=600)
    assert without.returncode == 0 and without.stdout.strip(), without.stderr
    notes = [line for line in without.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "4-bit kernel is not used" in notes[0], without.stderr
    assert "error" not in without.stderr.lower(), without.stderr


class Lines:
    """A process's stderr, read line by line in the background."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stderr.readline, "")), daemon=True)
        self._thread.start()

    def wait_for(self, text: str, proc: subprocess.Popen, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.05)

    def text(self) -> str:
        self._thread.join(10)
        return "".join(self.lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminated(args: list[str], env: dict, marker: str, timeout: float, check=lambda err: None) -> tuple[int, str]:
    """Run the app until `marker` is on its stderr (then `check(err)`), send SIGTERM, and give it
    `timeout` seconds to exit: its exit status and all of its stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.main", *args], env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        err = Lines(proc)
        err.wait_for(marker, proc)
        check(err)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err.text()


def still_loading(err: Lines) -> None:
    time.sleep(1)
    assert not any("ready:" in line for line in err.lines), err.lines


@pytest.mark.embedded
def test_sigterm_while_the_model_loads_ends_the_app_within_two_seconds(fresh_cache, tmp_path):
    stall = tmp_path / "slow-cc"  # a compiler that answers only once its caller is gone: loading waits on it
    stall.write_text("#!/bin/sh\nwhile kill -0 $PPID 2>/dev/null; do sleep 0.1; done\nexit 1\n")
    stall.chmod(0o755)
    env = {**fresh_cache, "CC": str(stall)}
    code, text = terminated(["--no-browser", "--port", str(free_port())], env, "running at", 2, still_loading)
    assert code == 0 and text.rstrip().endswith("medusa-chat stopped."), text
    assert "Traceback" not in text and "terminate called" not in text, text


@pytest.mark.embedded
def test_stderr_says_when_the_model_is_ready_and_that_no_browser_opens(fresh_cache):
    port = free_port()
    env = {k: v for k, v in fresh_cache.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    code, text = terminated(["--no-window", "--port", str(port)], env, "ready:", 60)
    url = f"http://127.0.0.1:{port}"
    assert f"ready: model smollm2-135m-instruct on {url}\n" in text, text
    assert f"no browser tab opens; the chat is at {url}." in text and "opened in the browser" not in text, text
    assert code == 0 and text.rstrip().endswith("medusa-chat stopped."), text
