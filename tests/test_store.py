"""Chat storage: damaged files are set aside (never lost, never fatal), ids cannot name paths,
kills leave no temporary files for good, exports fit the file system. No model, no network."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from app import store
from core.errors import UserError

ID = "0123456789ab"
OTHER = "ba9876543210"
STATS = {  # what run_turn stores for a finished Medusa reply
    "tokens": 12, "steps": 5, "seconds": 0.5, "tokens_per_step": 2.4, "tokens_per_second": 24.0,
    "first_token_seconds": 0.1, "finish_reason": "eos", "mode": "Medusa", "acceptance": "Lossless",
    "tree": "cpu-16", "drafter": "hybrid", "sources": {"heads": 2, "context": 1, "both": 0},
}  # fmt: skip


def chat_dict(chat_id: str = ID, **changes) -> dict:
    turn = {"user": "hi", "assistant": "hello there", "steps": [["hello", 0, ""], [" there", 1, "context"]],
            "stats": STATS, "finished": True}  # fmt: skip
    return {"id": chat_id, "title": "Greetings", "created": 1.5, "system": "", "model": "m", "turns": [turn]} | changes


def with_turn(**changes) -> dict:
    data = chat_dict()
    data["turns"][0] = data["turns"][0] | changes
    return data


def write(name: str, content: str | bytes | dict | None) -> Path:
    path = store.chats_dir() / name
    data = content if isinstance(content, (str, bytes)) else json.dumps(content)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


# -- 1, 7: valid JSON of the wrong shape is set aside, never fatal, never lost -----------------

WRONG_SHAPES = {
    "null": None,
    "number": 3,
    "list": [],
    "created not a number": chat_dict(created="x"),
    "created not finite": chat_dict(created=float("nan")),
    "title not text": chat_dict(title=["t"]),
    "unknown key": chat_dict(colour="red"),
    "missing id": {"title": "t", "created": 1.0},
    "turns not a list": chat_dict(turns={"user": "hi"}),
    "turn not a dict": chat_dict(turns=["hi"]),
    "turn without user": chat_dict(turns=[{"assistant": "x"}]),
    "turn unknown key": with_turn(extra=1),
    "steps not a list": with_turn(steps="hello"),
    "step not a list": with_turn(steps=[{"text": "hello"}]),
    "step text not text": with_turn(steps=[[1, 0]]),
    "step too long": with_turn(steps=[["a", 0, "heads", 4]]),
    "accepted a string": with_turn(steps=[["a", '1" onmouseover="alert(1)', "heads"]]),
    "accepted negative": with_turn(steps=[["a", -1]]),
    "accepted a bool": with_turn(steps=[["a", True]]),
    "unknown source": with_turn(steps=[["a", 1, "oracle"]]),
    "stats not a dict": with_turn(stats=[1, 2]),
    "partial stats": with_turn(stats={"tokens": 3}),
    "stats wrong type": with_turn(stats=STATS | {"tokens_per_second": "fast"}),
    "stats finish reason null": with_turn(stats=STATS | {"finish_reason": None}),
    "stats unknown key": with_turn(stats=STATS | {"mood": "good"}),
    "sources unknown kind": with_turn(stats=STATS | {"sources": {"oracle": 1}}),
    "finished not a bool": with_turn(finished="yes"),
    "inner id a path": chat_dict("../../evil"),
    "inner id another chat": chat_dict(OTHER),
    "nested too deep": "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("content", list(WRONG_SHAPES.values()), ids=list(WRONG_SHAPES))
def test_a_chat_file_of_the_wrong_shape_is_set_aside_and_the_rest_loads(home, content):
    """Old: AttributeError/TypeError/RecursionError escaped list_chats (the UI never built), or
    the file loaded and crashed rendering or named a path outside the chats folder."""
    write(f"{OTHER}.json", chat_dict(OTHER))
    damaged = write(f"{ID}.json", content)
    before = damaged.read_bytes()
    chats, problems = store.list_chats()
    assert problems == [f"A damaged chat file was set aside as {ID}.corrupt."]
    assert (store.chats_dir() / f"{ID}.corrupt").read_bytes() == before  # nothing lost
    assert not damaged.exists() and [c.id for c in chats] == [OTHER]


def test_a_file_not_named_like_a_chat_is_set_aside(home):
    """Old: loaded under the name "broken" and handed to the UI as a chat id."""
    write("broken.json", chat_dict() | {"id": "broken"})
    assert store.list_chats() == ([], ["A damaged chat file was set aside as broken.corrupt."])


def test_an_earlier_corrupt_file_is_never_overwritten(home):
    """Old: Path.replace moved the new damaged file over the earlier .corrupt one."""
    write(f"{ID}.corrupt", "first")
    write(f"{ID}.1.corrupt", "second")
    write(f"{ID}.json", '{"id": ')
    _, problems = store.list_chats()
    assert problems == [f"A damaged chat file was set aside as {ID}.2.corrupt."]
    folder = store.chats_dir()
    assert (folder / f"{ID}.corrupt").read_text() == "first" and (folder / f"{ID}.1.corrupt").read_text() == "second"
    assert (folder / f"{ID}.2.corrupt").read_text() == '{"id": '


def test_the_validator_says_what_is_wrong(home):
    with pytest.raises(store.ChatFileError, match=r"Turn 1, step 1, is not \[text"):
        store.chat_from_dict(WRONG_SHAPES["accepted a string"])
    with pytest.raises(store.ChatFileError, match="Turn 1's stats lack"):
        store.chat_from_dict(WRONG_SHAPES["partial stats"])


def test_chats_written_by_this_and_earlier_versions_load_unchanged(home):
    stats = {k: v for k, v in STATS.items() if k not in ("drafter", "sources")}  # before the lookup drafter
    old = with_turn(steps=[["hello", 0], [" there", 2]], stats=stats)
    write(f"{OTHER}.json", old | {"id": OTHER, "created": 1})
    chat = store.chat_from_dict(chat_dict())
    store.save_chat(chat)
    store.save_chat(store.Chat.new("m"))
    chats, problems = store.list_chats()
    assert problems == [] and len(chats) == 3
    assert store.load_chat(ID) == chat and chat.turns[0].steps[1] == (" there", 1, "context")
    assert store.load_chat(OTHER).turns[0].steps == [("hello", 0), (" there", 2)]


def test_unreadable_settings_give_defaults_and_stay_as_they_are(home):
    """Guard (already true before): the settings file is never rewritten on load."""
    store.settings_file().parent.mkdir(parents=True)
    store.settings_file().write_text("[not json")
    assert store.load_settings() == {}
    store.list_chats()
    assert store.settings_file().read_text() == "[not json"


# -- 2: ids never become paths outside the chats folder ----------------------------------------

BAD_IDS = ["../../x", "/abs/x", "0123456789AB", "0123456789ab\n", "", "0123456789abc", None]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_a_bad_id_is_refused_by_every_function(home, bad):
    """Old: load_chat("../../x") read, delete_chat("/abs/x") deleted, save_chat wrote, anywhere."""
    outside = home / "data" / "x.json"  # both chats/../../x.json and the absolute path
    outside.write_text(json.dumps(chat_dict()))
    bad = str(outside.with_suffix("")) if bad == "/abs/x" else bad
    for call in (store.load_chat, store.delete_chat, lambda bad: store.save_chat(store.Chat(bad, "t", 1.0))):
        with pytest.raises(UserError, match="is not a chat id"):  # a ChatIdError
            call(bad)
    assert outside.read_text() == json.dumps(chat_dict()) and not list(home.rglob("*.tmp"))
    assert issubclass(store.ChatIdError, UserError) and issubclass(store.ChatIdError, ValueError)


# -- 3: kills leave no temporary files; renames are flushed -----------------------------------


def test_stale_temporary_files_are_removed_and_fresh_ones_kept(home):
    """Old: every `kill -9` during a save left a `.*.tmp` file behind for good."""
    store.settings_file().parent.mkdir(parents=True)
    old_chat = write(f".{ID}.json.k3j4_x.tmp", "{")
    old_settings = store.settings_file().with_name(".settings.json.abc123.tmp")
    old_settings.write_text("{")
    fresh = write(f".{OTHER}.json.zz9.tmp", "{")  # another process may be saving right now
    unrelated = write("notes.tmp", "mine")
    stale = time.time() - 3600
    for path in (old_chat, old_settings, unrelated):
        os.utime(path, (stale, stale))
    store.list_chats()
    assert not old_chat.exists() and not old_settings.exists()
    assert fresh.exists() and unrelated.exists()


def test_write_atomic_flushes_the_folder_after_the_rename(home, monkeypatch):
    """Old: only the file was fsynced, so a power cut could lose the rename."""
    synced: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store.save_chat(store.Chat.new())
    assert synced == [False, True]


# -- 4, 5, 6: the chat handlers of the UI ------------------------------------------------------


@pytest.fixture
def handlers(home):
    """The UI's event handlers, built around an engine that never loads a model."""
    import warnings

    from app import ui
    from app.engine import Engine
    from models import catalog

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradio: the model is not among the dropdown's choices
        demo = ui.build(Engine(catalog.entries()[0].id))
    return {f.name: f.fn for f in demo.fns.values()}


def test_export_name_is_capped_in_bytes(home):
    """Old: 80 four-byte letters made a 320-byte name; the file system refuses over 255."""
    for title in ("𝐀" * 80, "😀" * 80, "日本語" * 50, "a" * 300, "", "../../etc"):
        name = store.export_name(title)
        assert len(name.encode()) <= store.EXPORT_NAME_BYTES + 3 and name.endswith(".md") and "/" not in name
        (home / name).write_text("ok")
    assert store.export_name("𝐀" * 80) == "𝐀" * 30 + ".md"


def test_export_of_a_chat_with_a_long_wide_title(handlers):
    """Old: OSError (File name too long) from the export button."""
    session = handlers["new_chat"](None, True)[1]
    session.chat.title = "𝐀" * 80
    path = Path(handlers["export"](session))
    assert path.read_text(encoding="utf-8").startswith("# " + "𝐀" * 80)


def test_rename_without_a_title_warns(handlers):
    """Old: AttributeError on None (the API sends None for an empty textbox)."""
    for empty in (None, "", " \n "):
        with pytest.warns(UserWarning, match="Type a title first"):
            handlers["rename"](empty, None)
    session = handlers["new_chat"](None, True)[1]
    handlers["rename"]("line one\nline two " + "x" * 200, session)
    assert session.chat.title.startswith("line one line two") and len(session.chat.title) == store.TITLE_CHARS


@pytest.mark.parametrize("damage", ["unknown source", "partial stats", "accepted a string"])
def test_open_chat_sets_a_damaged_file_aside_and_names_it(handlers, damage):
    """Old: KeyError from rendering (a traceback in the UI), or an attribute injected into the
    chat's HTML; the file stayed in the list."""
    write(f"{ID}.json", WRONG_SHAPES[damage])
    with pytest.warns(UserWarning, match=f"set aside as {ID}.corrupt"):
        out = handlers["open_chat"](ID, None, True)
    assert (store.chats_dir() / f"{ID}.corrupt").exists() and not (store.chats_dir() / f"{ID}.json").exists()
    assert out[4]["choices"] == [] and out[4]["value"] is None


def test_open_chat_with_a_bad_id_warns_and_moves_nothing(handlers, home):
    """Old: load_chat read "../../x.json" relative to the chats folder."""
    (home / "data" / "x.json").write_text(json.dumps(chat_dict()))
    with pytest.warns(UserWarning, match="is not a chat id"):
        handlers["open_chat"]("../../x", None, True)
    assert (home / "data" / "x.json").exists()


def test_open_chat_shows_a_valid_chat(handlers):
    write(f"{ID}.json", chat_dict())
    messages, session, title, stats_view, _ = handlers["open_chat"](ID, None, True)
    assert session.chat.id == ID and title == "Greetings" and "tokens / step" in stats_view
    assert 'data-source="context"' in messages[1]["content"]
