"""Chats and settings on disk: one JSON file per chat, written atomically after every turn.

A write goes to a temporary file in the same folder, is flushed to disk, then renamed over
the old one, so a crash or a kill leaves either the previous or the new version, never half
a file. A chat file that cannot be read is moved aside (`*.corrupt`) and reported, not fatal.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import platformdirs

log = logging.getLogger("medusa-chat")


def chats_dir() -> Path:
    return Path(platformdirs.user_data_dir("medusa-chat")) / "chats"


def settings_file() -> Path:
    return Path(platformdirs.user_config_dir("medusa-chat")) / "settings.json"


@dataclass
class Turn:
    user: str
    assistant: str = ""
    steps: list[tuple[str, int]] = field(default_factory=list)  # (text, drafted tokens accepted) per step
    stats: dict = field(default_factory=dict)  # tokens, steps, seconds, … of the reply
    finished: bool = False  # False while streaming or when stopped early


@dataclass
class Chat:
    id: str
    title: str
    created: float
    system: str = ""
    model: str = ""
    turns: list[Turn] = field(default_factory=list)

    @staticmethod
    def new(model: str = "", system: str = "") -> Chat:
        return Chat(uuid.uuid4().hex[:12], "New chat", time.time(), system, model)

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        if self.system:
            lines += [f"*System:* {self.system}", ""]
        for t in self.turns:
            lines += ["**You:**", "", t.user, "", "**Assistant:**", "", t.assistant, ""]
        return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_chat(chat: Chat) -> None:
    write_atomic(chats_dir() / f"{chat.id}.json", json.dumps(asdict(chat), ensure_ascii=False, indent=1))


def load_chat(chat_id: str) -> Chat:
    data = json.loads((chats_dir() / f"{chat_id}.json").read_text(encoding="utf-8"))
    turns = [Turn(**{**t, "steps": [tuple(s) for s in t.get("steps", [])]}) for t in data.pop("turns", [])]
    return Chat(**data, turns=turns)


def list_chats() -> tuple[list[Chat], list[str]]:
    """All readable chats, newest first, and a message for each file set aside as corrupt."""
    chats, problems = [], []
    for file in sorted(chats_dir().glob("*.json")):
        try:
            chats.append(load_chat(file.stem))
        except (OSError, ValueError, TypeError, KeyError) as e:
            aside = file.with_suffix(".corrupt")
            file.replace(aside)
            log.warning("chat file %s unreadable (%s); moved to %s", file, e, aside)
            problems.append(f"A damaged chat file was set aside as {aside.name}.")
    chats.sort(key=lambda c: c.created, reverse=True)
    return chats, problems


def delete_chat(chat_id: str) -> None:
    (chats_dir() / f"{chat_id}.json").unlink(missing_ok=True)


def load_settings() -> dict:
    try:
        data = json.loads(settings_file().read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("settings unreadable (%s); using defaults", e)
        return {}
    return data if isinstance(data, dict) else {}


def save_settings(settings: dict) -> None:
    write_atomic(settings_file(), json.dumps(settings, indent=1))
