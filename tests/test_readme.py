"""The README as a newcomer meets it: short, every link resolves, every command it shows runs as written.

Commands are checked against the program's own `--help` rather than run (most load a model): the
subcommand must exist and every `--option` a command uses must be one its help lists. The help of
every subcommand comes from one subprocess through the console script's entry point, so the whole
file runs in a few seconds. `docs/cli.md` is held to the same rule, and must name every option.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CLI_DOC = DOCS / "cli.md"
PROGRAM = "medusa-chat"
DEFAULT_COMMAND = "ui"  # `medusa-chat [options]` is `medusa-chat ui [options]`
MAX_LINES = 250

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELL_BLOCKS = {"sh", "bash", "shell", "console"}
INLINE_COMMAND = re.compile(rf"`({PROGRAM}(?: [^`]*)?)`")
SEPARATOR = re.compile(r"\s+(?:&&|\|\||\|)\s+|;\s+|;$")  # `a|b` without spaces is usage syntax, not a pipe
OPTION = re.compile(r"^\[?(--[a-z][a-z0-9-]*)")  # `--opt`, `--opt=v`, `[--opt` (usage syntax)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*$", re.M)
TEST_COMMAND = re.compile(r"<!-- test-command -->\s*\n```sh\n(.*?)\n```", re.S)
CHAT_COMMAND = re.compile(r"<!-- chat-command -->\s*\n```sh\n(.*?)\n```", re.S)

# Run in a subprocess: prints {"": root help, "ui": its help, ...} for the commands named in argv.
HELP_SCRIPT = """
import contextlib, io, json, sys
from {module} import {function} as main
helps = {{}}
for command in sys.argv[1:]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*command.split(), "--help"])
    helps[command] = out.getvalue()
print(json.dumps(helps))
"""


def entry_point() -> tuple[str, str]:
    """The module and function `pyproject.toml` installs as the `medusa-chat` console script."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(rf'^{PROGRAM}\s*=\s*"([\w.]+):(\w+)"', text, re.M)
    assert found, f"pyproject.toml has no [project.scripts] entry for {PROGRAM}"
    return found.group(1), found.group(2)


def _run_help(commands: list[str]) -> dict[str, str]:
    module, function = entry_point()
    script = HELP_SCRIPT.format(module=module, function=function)
    env = {**os.environ, "COLUMNS": "200"}  # wide help: no option split across lines
    done = subprocess.run(
        [sys.executable, "-c", script, *commands], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def helps() -> dict[str, str]:
    """`medusa-chat --help` (key "") and `medusa-chat COMMAND --help` for every command it lists."""
    root = _run_help([""])[""]
    listed = re.findall(r"^ {4}([a-z][\w-]*)(?: {2,}|$)", root, re.M)  # the COMMAND list's names
    assert DEFAULT_COMMAND in listed, root
    return {"": root, **_run_help(listed)}


def commands_in(markdown: str) -> list[list[str]]:
    """The words of every `medusa-chat …` command shown: in shell code blocks (continuation lines
    joined, chains split at `&&`, `||`, `|` and `;`, comments dropped) and in inline code spans."""
    found = []
    for language, body in FENCE.findall(markdown):
        if language not in SHELL_BLOCKS:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            for part in SEPARATOR.split(line):
                words = _words(part, comments=True)
                while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value before a command
                    words.pop(0)
                if words and words[0] == PROGRAM:
                    found.append(words)
    return found + [_words(span) for span in INLINE_COMMAND.findall(markdown)]


def _words(text: str, comments: bool = False) -> list[str]:
    try:
        return shlex.split(text, comments=comments)
    except ValueError:  # an unbalanced quote in usage text: plain words are enough here
        return (re.sub(r"(^|\s)#.*$", "", text) if comments else text).split()


def problems_with(command_words: list[str]) -> list[str]:
    """Why a command would not run as written: an unknown subcommand, an option its help lacks, or a
    value outside an option's choices (upper-case words such as `N` are usage placeholders)."""
    command, words = " ".join(command_words), command_words[1:]
    named = bool(words) and not words[0].startswith(("-", "["))
    sub = words[0] if named else DEFAULT_COMMAND
    if sub not in helps():
        return [f"`{command}`: `{sub}` is not a {PROGRAM} command"]
    known, choices = _options(helps()[sub]), _choices(helps()[sub])
    problems = []
    for word, value in itertools.pairwise([*words, ""]):
        if not (m := OPTION.match(word)):
            continue
        option = m.group(1)
        value = word.partition("=")[2] or value
        if option not in known:
            problems.append(f"`{command}`: {PROGRAM} {sub} has no option {option}")
        for v in value.strip("[]").split("|") if option in choices and not value.startswith(("-", "[")) else []:
            if not v.isupper() and v not in choices[option]:  # NAME, N, F: placeholders in usage text
                problems.append(f"`{command}`: {option} takes one of {sorted(choices[option])}, not {v}")
    return problems


def _options(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_text))


def _choices(help_text: str) -> dict[str, set[str]]:
    """The options argparse shows with a set of values, `--mode {medusa,baseline}`, and those values."""
    return {
        option: set(values.split(",")) for option, values in re.findall(r"(--[a-z][a-z0-9-]*) \{([^}]*)\}", help_text)
    }


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lowercase, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)):
        slug = github_anchor(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(page: Path) -> list[str]:
    """Relative links (documents, images, `#anchors`) in `page` that point at nothing."""
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{page.name}: {target} (no such heading)")
    return broken


def stale_code_references(page: Path) -> list[str]:
    """`core/x/y.py`, `core/x/` and `core.x.y.Name` in `page` that name no file, module or definition."""
    stale = []
    for ref in re.findall(r"`((?:core|app|models)[./][\w./]*)`", page.read_text(encoding="utf-8")):
        if "/" in ref:
            stale += [] if (ROOT / ref).exists() else [ref]
            continue
        parts = ref.split(".")
        depth = max((n for n in range(1, len(parts) + 1) if _module_file(parts[:n])), default=0)
        module, names = _module_file(parts[:depth]), parts[depth:]
        defined = module is not None  # of `Class.method`, the class is checked
        if defined and names:
            defined = bool(
                re.search(
                    rf"^\s*(?:def|class)\s+{names[0]}\b|^{names[0]}\s*[:=]", module.read_text(encoding="utf-8"), re.M
                )
            )
        stale += [] if defined else [ref]
    return stale


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    found = [f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()]
    return found[0] if found else None


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/ (at most {MAX_LINES})"


def test_readme_and_docs_links_resolve():
    pages = [README, *sorted(DOCS.glob("*.md"))]
    assert [p for page in pages for p in broken_links(page)] == []


def test_readme_keeps_the_two_set_up_commands_where_ci_finds_them():
    text = README.read_text(encoding="utf-8")
    test, chat = TEST_COMMAND.search(text), CHAT_COMMAND.search(text)
    assert test and chat, "README.md lost a <!-- test-command --> or <!-- chat-command --> block (.ci/run reads it)"
    for step in ("pip install -e '.[test", "ruff format --check .", "ruff check .", "pytest"):
        assert step in test.group(1), step
    assert chat.group(1).rstrip().endswith(PROGRAM)


def test_every_readme_command_runs_as_written():
    commands = commands_in(README.read_text(encoding="utf-8"))
    assert {" ".join(c[:2]) for c in commands} >= {
        PROGRAM,
        f"{PROGRAM} generate",
        f"{PROGRAM} bench",
        f"{PROGRAM} models",
    }
    assert [p for command in commands for p in problems_with(command)] == []


def test_cli_doc_shows_only_real_commands_and_names_every_option():
    text = CLI_DOC.read_text(encoding="utf-8")
    assert [p for command in commands_in(text) for p in problems_with(command)] == []
    missing = [
        f"{sub or PROGRAM}: {option}"
        for sub, help_text in helps().items()
        for option in sorted(_options(help_text) - {"--help"})
        if not re.search(rf"(?<![\w-]){option}(?![\w-])", text)
    ]
    assert missing == [], "docs/cli.md does not describe these options"
    assert [sub for sub in helps() if sub and f"`{PROGRAM} {sub}" not in text and f"`{sub}`" not in text] == []


def test_docs_name_code_that_exists():
    pages = [README, *sorted(DOCS.glob("*.md"))]
    assert [f"{page.name}: {ref}" for page in pages for ref in stale_code_references(page)] == []


def test_command_extraction():
    markdown = (
        "```sh\nVAR=1 medusa-chat generate --prompt 'a # b' \\\n    --json  # comment\n"
        "pip install x && medusa-chat\nmedusa-chat bench [--modes a|b] | tee out\n```\n"
        "```python\nmedusa-chat = 1\n```\nrun `medusa-chat models` or `medusa-chat`."
    )
    assert commands_in(markdown) == [
        ["medusa-chat", "generate", "--prompt", "a # b", "--json"],
        ["medusa-chat"],
        ["medusa-chat", "bench", "[--modes", "a|b]"],
        ["medusa-chat", "models"],
        ["medusa-chat"],
    ]
    assert github_anchor("`medusa-chat ui`: the chat") == "medusa-chat-ui-the-chat"
    assert github_anchor("The speculation policy (`--tree auto`)") == "the-speculation-policy---tree-auto"
