"""The `medusa-chat` command line: a local chat that decodes several tokens per step.

`medusa-chat` alone opens the chat (the `ui` command and all its options); the other commands
answer a prompt, benchmark decoding modes, list and fetch models, train and calibrate drafters,
and add the app to the desktop's menu. Every mistake a user can make ends here as one sentence
on stderr and exit status 2; an unexpected failure prints one sentence and leaves the traceback
in the log file. stdout carries only what a command was asked for: the reply, its JSON, a table.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import platformdirs

from app.cli import catalog
from core.errors import UserError

log = logging.getLogger("medusa-chat")

DEFAULT_COMMAND = "ui"
# the commands each defined by the module of its name under app.cli (an underscore for a dash)
MODULES = (
    "ui",
    "generate",
    "bench",
    "profile",
    "train-heads",
    "train-drafter",
    "calibrate",
    "export",
    "install-desktop",
)
COMMANDS = (*MODULES, "models", "download")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one `error:` sentence (like every other mistake), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}; see `{self.prog} --help`.\n")


def parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `command` (None: of every command, for the program's help). Only the command
    run is imported, so a mistake in its options is refused before torch or the web server load."""
    root = _Parser(
        prog="medusa-chat",
        description=__doc__.split("\n\n")[0],
        epilog="Without a command it opens the chat: `medusa-chat [--port P] [--no-browser] [--model M] …` "
        "takes every option of `medusa-chat ui`.",
    )
    sub = root.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in MODULES:
        if command not in (None, name):
            sub.add_parser(name)
            continue
        module = importlib.import_module(f"app.cli.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__.splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(run=module.run, check=getattr(module, "check", None))
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
    argv = with_command(sys.argv[1:] if argv is None else argv)
    args = parser(argv[0] if argv[0] in COMMANDS else None).parse_args(argv)
    _setup_logging()
    try:
        if getattr(args, "check", None):  # what a command can refuse before anything heavy is imported
            args.check(args)
        _quiet_transformers()
        return args.run(args)
    except (Exception, KeyboardInterrupt) as e:
        return report(e)


def entry(argv: list[str] | None = None) -> int:
    """The `medusa-chat` program: `main`, then its objects frozen for the exit, whose last garbage
    collection would otherwise walk every object torch and transformers made (0.6-1.2 s of a
    `generate` on two cores; the memory goes back to the system either way)."""
    code = main(argv)
    gc.freeze()
    return code


def report(error: BaseException) -> int:
    """Say on stderr how a command failed, in one sentence, and return its exit status: 2 for a
    mistake of the user's, 130 for Ctrl-C, 1 for anything else (its traceback goes to the log)."""
    if isinstance(error, UserError):
        print(f"error: {error}", file=sys.stderr)
        return 2
    if isinstance(error, KeyboardInterrupt):
        print("\ninterrupted", file=sys.stderr)
        return 130
    log.error("unexpected failure\n%s", "".join(traceback.format_exception(error)))
    print(f"error: unexpected {type(error).__name__}: {error} (details in {_log_file()})", file=sys.stderr)
    return 1


def _log_file() -> Path:
    return Path(platformdirs.user_log_dir("medusa-chat")) / "medusa-chat.log"


def _setup_logging() -> None:
    file = _log_file()
    file.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=file, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own messages say what is loading
    hf_logging.set_verbosity_error()


if __name__ == "__main__":
    sys.exit(entry())
