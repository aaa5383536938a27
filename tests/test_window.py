"""The chat in a window of its own (under Xvfb), the browser fallback, and the app-menu launcher."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import pytest
from gradio_client import Client
from PIL import Image, ImageStat

from app import store, window
from app.cli import install_desktop
from app.cli import ui as ui_cli
from tests.test_ui import free_port, send_args

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="X11 and XDG menus are Linux's")


def medusa_chat(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.main", *args], env=env, capture_output=True, text=True, timeout=120
    )


def user_dirs(home: Path) -> dict[str, str]:
    """Fresh data, config and state folders (the converted model stays in the user's cache)."""
    return {f"XDG_{k}_HOME": str(home / k.lower()) for k in ("DATA", "CONFIG", "STATE")}


# -- why there is no window ------------------------------------------------------------------


def test_window_problem_names_the_reason(monkeypatch):
    monkeypatch.setenv("DISPLAY", ":0")
    assert window.window_problem(no_window=True) == "--no-window was given"
    monkeypatch.setattr(window, "EXTRA", {"webview": "pywebview", "no_such.module": "no-such-package"})
    assert window.window_problem(no_window=False) == (
        "no-such-package is not installed (the window comes with `pip install 'medusa-chat[desktop]'`)"
    )


@LINUX
def test_window_problem_without_a_display(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert "no display" in window.window_problem(no_window=False)
    monkeypatch.setenv("DISPLAY", ":0")
    assert window.window_problem(no_window=False) is None  # the extra and Qt's X11 libraries are installed


def test_present_falls_back_to_the_browser_with_one_sentence(monkeypatch, capsys):
    opened, waited = [], []
    monkeypatch.setenv("DISPLAY", ":0")  # a browser can open
    monkeypatch.setattr(ui_cli.webbrowser, "open", lambda url: opened.append(url) or True)
    monkeypatch.setattr(ui_cli, "_wait_for_interrupt", lambda: waited.append(True))
    monkeypatch.setattr(window, "run_window", lambda *a: pytest.fail("no window was wanted"))
    ui_cli._present("http://127.0.0.1:1234", Namespace(no_window=True, no_browser=False))
    err = capsys.readouterr().err
    assert opened == ["http://127.0.0.1:1234"] and waited == [True]
    assert err.count("\n") == 1 and "--no-window was given" in err and "opened in the browser" in err

    opened.clear()
    ui_cli._present("http://127.0.0.1:1234", Namespace(no_window=False, no_browser=True))
    err = capsys.readouterr().err  # headless: nothing shown, and one sentence says so
    assert opened == [] and err.count("\n") == 1 and "No window or browser tab opens" in err
    assert "http://127.0.0.1:1234" in err


def test_present_says_where_the_chat_is_when_no_browser_can_open(monkeypatch, capsys):
    opened = []
    monkeypatch.setattr(ui_cli.webbrowser, "open", lambda url: opened.append(url) or False)
    monkeypatch.setattr(ui_cli, "_wait_for_interrupt", lambda: None)
    monkeypatch.setattr(window, "run_window", lambda *a: pytest.fail("no window was wanted"))
    monkeypatch.setenv("DISPLAY", ":0")  # a display, but no browser that opens
    ui_cli._present("http://127.0.0.1:1234", Namespace(no_window=True, no_browser=False))
    err = capsys.readouterr().err
    assert opened and err.count("\n") == 1 and "no browser tab opens; the chat is at http://127.0.0.1:1234" in err
    opened.clear()
    monkeypatch.delenv("DISPLAY")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.delenv("BROWSER", raising=False)
    ui_cli._present("http://127.0.0.1:1234", Namespace(no_window=False, no_browser=False))
    err = capsys.readouterr().err  # no display: no browser is tried (a text one would take the terminal)
    assert opened == [] and err.count("\n") == 1 and "no display" in err and "the chat is at" in err


def test_a_window_that_fails_to_open_falls_back_to_the_browser(monkeypatch, capsys):
    def broken(*args: object) -> None:
        raise RuntimeError("Qt is broken")

    opened = []
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr(window, "window_problem", lambda no_window: None)
    monkeypatch.setattr(window, "run_window", broken)
    monkeypatch.setattr(ui_cli.webbrowser, "open", lambda url: opened.append(url) or True)
    monkeypatch.setattr(ui_cli, "_wait_for_interrupt", lambda: None)
    ui_cli._present("http://127.0.0.1:1234", Namespace(no_window=False, no_browser=False))
    assert opened == ["http://127.0.0.1:1234"] and "Qt is broken" in capsys.readouterr().err


# -- the launcher ----------------------------------------------------------------------------


def test_exec_arguments_are_quoted_as_the_desktop_entry_spec_says():
    assert install_desktop._exec_quote("/usr/bin/medusa-chat") == "/usr/bin/medusa-chat"
    assert install_desktop._exec_quote("/home/a b/$x/100%") == '"/home/a b/\\$x/100%%"'
    entry = install_desktop.desktop_entry(["/opt/my apps/medusa-chat"])
    assert 'Exec="/opt/my apps/medusa-chat"\n' in entry
    # inside quotes \" and \\, then every backslash doubled by the string escape
    assert 'Exec="/x/\\\\"q\\\\"\\\\\\\\y"' in install_desktop.desktop_entry(['/x/"q"\\y'])


@LINUX
def test_install_desktop_writes_its_files_once_and_uninstall_removes_exactly_them(tmp_path, monkeypatch, capsys):
    env = {**os.environ, **user_dirs(tmp_path)}
    data = tmp_path / "data"

    first = medusa_chat("install-desktop", env=env)  # the real command once; then its module, in this process
    assert first.returncode == 0, first.stderr
    written = [Path(line) for line in first.stdout.splitlines()]
    assert sorted(written) == sorted(p for p in data.rglob("*") if p.is_file())
    assert {p.relative_to(data).as_posix() for p in written} == {
        "applications/medusa-chat.desktop",
        "icons/hicolor/256x256/apps/medusa-chat.png",
        "icons/hicolor/scalable/apps/medusa-chat.svg",
    }
    entry = (data / "applications" / "medusa-chat.desktop").read_text()
    fields = dict(line.split("=", 1) for line in entry.splitlines()[1:])
    assert entry.startswith("[Desktop Entry]\n") and fields["Terminal"] == "false"
    assert fields["Icon"] == fields["StartupWMClass"] == fields["Name"] == "medusa-chat"
    assert fields["Exec"] == str(Path(shutil.which("medusa-chat")).resolve())  # this install's executable
    assert Image.open(written[1]).size == (256, 256)
    stamps = {p: p.stat().st_mtime_ns for p in written}

    monkeypatch.setenv("XDG_DATA_HOME", str(data))

    def command(uninstall: bool) -> tuple[str, str]:
        assert install_desktop.run(Namespace(uninstall=uninstall)) == 0
        return capsys.readouterr()

    out, err = command(uninstall=False)
    assert out == first.stdout and "up to date" in err
    assert {p: p.stat().st_mtime_ns for p in written} == stamps  # nothing rewritten

    (data / "applications" / "other.desktop").write_text("[Desktop Entry]\n")  # not ours: left alone
    out, _ = command(uninstall=True)
    assert sorted(map(Path, out.splitlines())) == sorted(written)
    assert [p for p in data.rglob("*") if p.is_file()] == [data / "applications" / "other.desktop"]

    out, err = command(uninstall=True)
    assert out == "" and err.count("\n") == 1 and "Nothing to remove" in err


# -- the real window under Xvfb --------------------------------------------------------------


@pytest.fixture
def display(tmp_path) -> Iterator[str]:
    """A virtual X display of its own (Xvfb picks a free number and tells it through a pipe)."""
    read, write = os.pipe()
    xvfb = subprocess.Popen(
        ["Xvfb", "-displayfd", str(write), "-screen", "0", "1400x900x24", "-nolisten", "tcp"],
        pass_fds=(write,), stderr=open(tmp_path / "xvfb.log", "w"),  # noqa: SIM115
    )  # fmt: skip
    os.close(write)
    with os.fdopen(read) as f:
        number = f.readline().strip()
    assert number, (tmp_path / "xvfb.log").read_text()
    yield f":{number}"
    xvfb.terminate()
    xvfb.wait(10)


def app_window(display: str) -> tuple[int, int, int, int, int] | None:
    """The app's top-level window on `display`: (id, width, height, x, y), or None."""
    tree = subprocess.run(["xwininfo", "-root", "-tree", "-display", display], capture_output=True, text=True).stdout
    for m in re.finditer(
        r'(0x[0-9a-f]+) "medusa-chat": \("medusa-chat" "medusa-chat"\)\s+(\d+)x(\d+)\+(-?\d+)\+(-?\d+)', tree
    ):
        return int(m[1], 16), int(m[2]), int(m[3]), int(m[4]), int(m[5])
    return None


def close_window(display: str, window_id: int) -> None:
    """What a window manager does when the user clicks the close button: send WM_DELETE_WINDOW."""
    x11 = ctypes.CDLL(ctypes.util.find_library("X11"))
    x11.XOpenDisplay.restype, x11.XOpenDisplay.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    x11.XInternAtom.restype, x11.XInternAtom.argtypes = ctypes.c_ulong, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    x11.XSendEvent.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    x11.XFlush.argtypes = x11.XCloseDisplay.argtypes = [ctypes.c_void_p]

    class ClientMessage(ctypes.Structure):  # XClientMessageEvent, padded to the size of an XEvent
        _fields_ = [("type", ctypes.c_int), ("serial", ctypes.c_ulong), ("send_event", ctypes.c_int),
                    ("display", ctypes.c_void_p), ("window", ctypes.c_ulong), ("message_type", ctypes.c_ulong),
                    ("format", ctypes.c_int), ("data", ctypes.c_long * 5), ("pad", ctypes.c_long * 12)]  # fmt: skip

    dpy = x11.XOpenDisplay(display.encode())
    assert dpy, f"cannot open {display}"
    event = ClientMessage(type=33, window=window_id, format=32)  # 33: ClientMessage
    event.message_type = x11.XInternAtom(dpy, b"WM_PROTOCOLS", 0)
    event.data[0] = x11.XInternAtom(dpy, b"WM_DELETE_WINDOW", 0)
    assert x11.XSendEvent(dpy, window_id, 0, 0, ctypes.byref(event))
    x11.XFlush(dpy)
    x11.XCloseDisplay(dpy)


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        found |= set(kids := children.get(todo.pop(), []))
        todo += kids
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_exit(pids: set[int], timeout: float) -> dict[int, str]:
    """The processes among `pids` still running after `timeout` seconds, with their command lines."""
    deadline = time.time() + timeout
    while (left := {p: command_line(p) for p in pids if alive(p)}) and time.time() < deadline:
        time.sleep(0.2)
    return left


def wait_until(condition, timeout: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the app ended while waiting for {what}:\n{log.read_text()}"
        if result := condition():
            return result
        time.sleep(0.5)
    raise TimeoutError(f"{what} within {timeout} s:\n{log.read_text()}")


def ready(url: str) -> Client | None:
    try:
        client = Client(url, verbose=False)
        return client if "Ready:" in client.predict(api_name="/status")[0] else None
    except Exception:  # not serving yet
        return None


def spread(png: Path, box: tuple[int, int, int, int]) -> tuple[int, float]:
    """How much is drawn in `box` of a screenshot: distinct colors and the mean channel deviation."""
    image = Image.open(png).convert("RGB").crop(box)
    return len(image.getcolors(maxcolors=1 << 24)), sum(ImageStat.Stat(image).stddev) / 3


@LINUX
@pytest.mark.embedded
def test_the_chat_opens_in_its_own_window_and_closing_it_ends_the_app(display, tmp_path, monkeypatch):
    port, log = free_port(), tmp_path / "app.log"
    env = {**os.environ, **user_dirs(tmp_path), "DISPLAY": display}
    env.pop("WAYLAND_DISPLAY", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.main", "--port", str(port)], env=env, stdout=out, stderr=out
        )
    try:
        wid, width, height, x, y = wait_until(lambda: app_window(display), 120, "the window", proc, log)
        assert (width, height) == window.SIZE
        client = wait_until(lambda: ready(f"http://127.0.0.1:{port}/"), 180, "the model", proc, log)
        time.sleep(5)  # the page's first paint in software GL
        shot = tmp_path / "window.png"
        subprocess.run(["import", "-display", display, "-window", "root", f"png:{shot}"], check=True, timeout=60)
        colors, deviation = spread(shot, (x, y, x + width, y + height))
        assert colors > 200 and deviation > 10, f"the window looks blank: {colors} colors, deviation {deviation:.1f}"
        assert any("QtWebEngine" in command_line(p) for p in descendants(proc.pid)), "the window is no web view"

        job = client.submit(*send_args("Write a very long story about a lighthouse keeper.", 2048), api_name="/send")
        wait_until(lambda: len(job.outputs()) >= 3, 120, "a streaming reply", proc, log)
        children = descendants(proc.pid)
        started = time.time()
        close_window(display, wid)  # mid-reply
        assert proc.wait(60) == 0, log.read_text()
        print(f"closed in {time.time() - started:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    left = wait_for_exit(children, 10)  # Chromium's helpers notice their parent is gone within moments
    assert not left, f"processes left behind after the window closed: {left}"
    assert "medusa-chat stopped." in log.read_text()
    monkeypatch.setenv("XDG_DATA_HOME", env["XDG_DATA_HOME"])
    chats, problems = store.list_chats()
    assert problems == [] and len(chats) == 1  # closed mid-reply: nothing damaged, the reply so far kept
    turn = chats[0].turns[-1]
    assert "lighthouse" in turn.user and turn.assistant and turn.steps and not turn.finished


@LINUX
@pytest.mark.embedded
def test_without_a_display_the_browser_opens_and_says_why(tmp_path):
    port, log, opened = free_port(), tmp_path / "app.log", tmp_path / "opened"
    browser = tmp_path / "browser"
    browser.write_text(f'#!/bin/sh\necho "$1" > {opened}\n')
    browser.chmod(0o755)
    env = {**os.environ, **user_dirs(tmp_path), "BROWSER": str(browser)}  # webbrowser runs $BROWSER URL
    env.pop("DISPLAY", None)
    env.pop("WAYLAND_DISPLAY", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.main", "--port", str(port)], env=env, stdout=out, stderr=out
        )
    try:
        wait_until(lambda: opened.exists() and opened.read_text(), 120, "the browser", proc, log)
        assert opened.read_text().strip() == f"http://127.0.0.1:{port}"
        said = [line for line in log.read_text().splitlines() if "instead of a window" in line]
        assert len(said) == 1 and "no display" in said[0], log.read_text()
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
