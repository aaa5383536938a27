"""The `medusa-chat` command line: a local chat that decodes several tokens per step.

`medusa-chat` alone opens the chat (the `ui` command and all its options); the other commands
answer a prompt, benchmark decoding modes, list and fetch models, train and calibrate drafters,
and add the app to the desktop's menu. Every mistake a user can make ends here as one sentence
on stderr and exit status 2; an unexpected failure prints one sentence and leaves the traceback
in the log file. stdout carries only what a command was asked for: the reply, its JSON, a table.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import platformdirs

from app.cli import (
    bench,
    calibrate,
    catalog,
    export,
    generate,
    install_desktop,
    profile,
    train_drafter,
    train_heads,
    ui,
)  # fmt: skip
from core.errors import UserError

log = logging.getLogger("medusa-chat")

DEFAULT_COMMAND = "ui"
MODULES = {
    "ui": ui, "generate": generate, "bench": bench, "profile": profile, "train-heads": train_heads,
    "train-drafter": train_drafter, "calibrate": calibrate, "export": export, "install-desktop": install_desktop,
}  # fmt: skip
COMMANDS = (*MODULES, "models", "download")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one `error:` sentence (like every other mistake), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see `{self.prog} --help`.\n")


def parser() -> argparse.ArgumentParser:
    root = _Parser(
        prog="medusa-chat",
        description=__doc__.split("\n\n")[0],
        epilog="Without a command it opens the chat: `medusa-chat [--port P] [--no-browser] [--model M] …` "
        "takes every option of `medusa-chat ui`.",
    )
    sub = root.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, module in MODULES.items():
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__.splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    sub.add_parser("models", help="list the model catalog and what is downloaded").set_defaults(run=catalog.run_models)
    download = sub.add_parser("download", help="fetch a catalog model (backbone and heads)")
    download.add_argument("id", help="catalog id (see `medusa-chat models`) or hub repo id")
    download.set_defaults(run=catalog.run_download)
    return root


def with_command(argv: list[str]) -> list[str]:
    """`medusa-chat [ui options]` means `medusa-chat ui [ui options]`; help stays the program's."""
    if argv and (argv[0] in COMMANDS or argv[0] in ("-h", "--help")):
        return argv
    return [DEFAULT_COMMAND, *argv]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(with_command(sys.argv[1:] if argv is None else argv))
    _setup_logging()
    try:
        return args.run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:
        log.error("unexpected failure\n%s", traceback.format_exc())
        print(f"error: unexpected {type(e).__name__}: {e} (details in {_log_file()})", file=sys.stderr)
        return 1


def _log_file() -> Path:
    return Path(platformdirs.user_log_dir("medusa-chat")) / "medusa-chat.log"


def _setup_logging() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own messages say what is loading
    hf_logging.set_verbosity_error()
    file = _log_file()
    file.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=file, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")


if __name__ == "__main__":
    sys.exit(main())
