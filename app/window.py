"""The chat in a native window of its own, or one sentence saying why there can be none.

The window is a web view (pywebview on Qt, from the `[desktop]` extra) of the page the local
server already serves; it knows nothing about the chat, the model or the server. Whoever calls
`run_window` stops the server once it returns.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import signal
import sys
from importlib import resources
from pathlib import Path

APP_ID = "medusa-chat"  # the window's title and WM_CLASS, the launcher's and the icon's file name
EXTRA = {"webview": "pywebview", "qtpy": "qtpy", "PyQt6.QtWebEngineWidgets": "PyQt6-WebEngine"}  # the [desktop] extra
SIZE = (1280, 860)  # the window's first size in pixels: the sidebar, the chat and the stats side by side


def icon(ext: str = "png") -> Path:
    """The app's icon shipped in assets/icons: "png" (256×256) or "svg"."""
    return Path(str(resources.files("assets") / "icons" / f"{APP_ID}.{ext}"))


def window_problem(no_window: bool) -> str | None:
    """Why a native window cannot be used here, as the end of a sentence; None when it can."""
    if no_window:
        return "--no-window was given"
    if sys.platform.startswith("linux"):
        if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
            return "there is no display ($DISPLAY and $WAYLAND_DISPLAY are unset)"
        if not os.environ.get("WAYLAND_DISPLAY") and not ctypes.util.find_library("xcb-cursor"):
            # without it Qt's X11 plugin aborts the whole process instead of raising
            return "Qt's X11 plugin needs libxcb-cursor0, which is not installed"
    if missing := [package for module, package in EXTRA.items() if not _importable(module)]:
        return f"{missing[0]} is not installed (the window comes with `pip install 'medusa-chat[desktop]'`)"
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package that is missing or broken
        return False


def run_window(url: str, title: str = APP_ID, icon_file: Path | None = None) -> None:
    """Show `url` in a window titled `title` and return once the user has closed it (or on
    SIGINT/SIGTERM, which close it). Must run on the main thread (Qt's rule)."""
    _qt_environment()
    import webview
    from qtpy.QtCore import QCoreApplication

    QCoreApplication.setApplicationName(APP_ID)  # WM_CLASS's class, whatever started Python

    window = webview.create_window(title, url, width=SIZE[0], height=SIZE[1], min_size=(480, 360))
    assert window is not None  # only None when called from a thread while a GUI already runs

    def close(signum: int, frame: object) -> None:
        window.destroy()

    previous = {s: signal.signal(s, close) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        webview.start(gui="qt", icon=str(icon_file or icon()))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _qt_environment() -> None:
    """Settings Qt reads when it starts; the user's own values win."""
    os.environ.setdefault("QT_API", "pyqt6")  # the Qt binding the extra installs
    os.environ.setdefault("RESOURCE_NAME", APP_ID)  # WM_CLASS's instance (the launcher's StartupWMClass)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Chromium (inside QtWebEngine) refuses to start its sandbox as root and exits; root is
        # what containers and CI run as
        os.environ.setdefault("QTWEBENGINE_CHROMIUM_FLAGS", "--no-sandbox")
