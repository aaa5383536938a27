"""`medusa-chat install-desktop`: medusa-chat in the desktop's app menu, with its icon.

Writes an XDG desktop entry, `$XDG_DATA_HOME/applications/medusa-chat.desktop` (XDG_DATA_HOME
defaults to ~/.local/share), that runs this very `medusa-chat` executable, and the icon into
the hicolor theme beside it. stdout lists the files; `--uninstall` removes exactly those.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import platformdirs

from app.cli.options import writable
from app.window import APP_ID, icon
from core.errors import UserError

HELP = "add medusa-chat to the desktop's app menu (--uninstall removes it)"
COMMENT = "A private chat with a model on this machine, several tokens per step"
EXEC_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")  # an Exec argument holding one of these is quoted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--uninstall", action="store_true", help="remove the launcher and icon this command installs")


def run(args: argparse.Namespace) -> int:
    if sys.platform in ("darwin", "win32"):
        raise UserError(f"install-desktop writes a Linux (XDG) app-menu entry, which {sys.platform} does not read.")
    return _uninstall() if args.uninstall else _install()


def files(command: list[str]) -> dict[Path, bytes]:
    """Every file the launcher consists of → its content, for a launcher that runs `command`."""
    icons = platformdirs.user_data_path() / "icons" / "hicolor"
    return {
        _applications() / f"{APP_ID}.desktop": desktop_entry(command).encode(),
        icons / "256x256" / "apps" / f"{APP_ID}.png": icon("png").read_bytes(),
        icons / "scalable" / "apps" / f"{APP_ID}.svg": icon("svg").read_bytes(),
    }


def _applications() -> Path:
    return platformdirs.user_data_path() / "applications"  # $XDG_DATA_HOME, else ~/.local/share


def desktop_entry(command: list[str]) -> str:
    exec_line = " ".join(_exec_quote(a) for a in command).replace("\\", "\\\\")  # the string escape comes last
    return (
        "[Desktop Entry]\n"
        "Type=Application\n"
        f"Name={APP_ID}\n"
        "GenericName=Local chat\n"
        f"Comment={COMMENT}\n"
        f"Exec={exec_line}\n"
        f"Icon={APP_ID}\n"
        "Terminal=false\n"
        "Categories=Utility;\n"
        "Keywords=chat;LLM;Medusa;assistant;\n"
        f"StartupWMClass={APP_ID}\n"  # the window's WM_CLASS (app/window.py)
    )


def _exec_quote(arg: str) -> str:
    """One Exec argument as the desktop-entry spec wants it: double quotes around reserved
    characters, backslash before " ` $ \\ inside them, and % doubled."""
    if any(c in EXEC_RESERVED for c in arg):
        arg = '"' + re.sub(r'(["`$\\])', r"\\\1", arg) + '"'
    return arg.replace("%", "%%")


def this_command() -> list[str]:
    """The absolute command that started this `medusa-chat` (so the launcher runs this install)."""
    argv0 = Path(sys.argv[0])
    if argv0.name == APP_ID and argv0.is_file():
        return [str(argv0.resolve())]
    if found := shutil.which(APP_ID):
        return [str(Path(found).resolve())]
    return [sys.executable, "-m", "app.main"]  # `python -m app.main` from a checkout without the script


def _install() -> int:
    from app.atomic import write_atomic

    wanted = files(this_command())
    changed = [path for path, content in wanted.items() if not path.is_file() or path.read_bytes() != content]
    for folder in dict.fromkeys(path.parent for path in changed):  # all refused before any file is written
        writable(folder, "XDG_DATA_HOME", folder=True)
    for path in changed:
        try:
            write_atomic(path, wanted[path])
        except OSError as e:
            reason = e.strerror or str(e)
            raise UserError(
                f"Cannot write {path} ({reason}); set XDG_DATA_HOME to a folder you can write to."
            ) from None
    print("\n".join(str(p) for p in wanted))
    if changed:
        _refresh_menu()
        print(
            f"Installed medusa-chat in the app menu ({len(changed)} of {len(wanted)} files written).", file=sys.stderr
        )
    else:
        print("The app-menu entry and icons are already up to date.", file=sys.stderr)
    return 0


def _uninstall() -> int:
    present = [path for path in files(this_command()) if path.is_file()]
    for path in present:
        path.unlink()
    if not present:
        print("Nothing to remove: medusa-chat is not installed in this app menu.", file=sys.stderr)
        return 0
    print("\n".join(str(p) for p in present))
    _refresh_menu()
    print(f"Removed medusa-chat from the app menu ({len(present)} files).", file=sys.stderr)
    return 0


def _refresh_menu() -> None:
    """Menus that cache entries notice at once; others rescan the folder anyway."""
    if (tool := shutil.which("update-desktop-database")) and _applications().is_dir():
        subprocess.run([tool, "-q", str(_applications())], check=False, capture_output=True)
