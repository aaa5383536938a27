"""Chat files that lose nothing and take nothing down (issue 30): every string valid Unicode,
no symbolic link followed, the chat list from an index (a page load reads no chat), the user's
message on disk before its reply starts. No model, no network."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from app import store, ui, ui_session
from app.controls import DEFAULTS, NAMES
from app.engine import Engine, Reply
from core.decode.generate import Finished, StepEvent
from models import catalog

ID, OTHER = "0123456789ab", "ba9876543210"
SURROGATE = "\\ud800"  # as JSON spells it: valid JSON, a str that UTF-8 cannot carry
CONTROLS = tuple(DEFAULTS[name] for name in NAMES)


def chat_json(chat_id: str = ID, title: str = '"Greetings"', **spelled: str) -> str:
    """A chat file's text, with some values spelled as raw JSON (to plant escapes)."""
    v = {"title": title, "system": '""', "model": '"m"', "user": '"hi"', "assistant": '"hello"', "step": '"hello"',
         "finish_reason": '"eos"', "mode": '"Medusa"'} | spelled  # fmt: skip
    stats = (
        '{"tokens": 1, "steps": 1, "seconds": 0.5, "tokens_per_step": 1.0, "tokens_per_second": 2.0, '
        f'"first_token_seconds": 0.1, "finish_reason": {v["finish_reason"]}, "mode": {v["mode"]}}}'
    )
    turn = (
        f'{{"user": {v["user"]}, "assistant": {v["assistant"]}, "steps": [[{v["step"]}, 0, ""]], '
        f'"stats": {stats}, "finished": true}}'
    )
    return (
        f'{{"id": "{chat_id}", "title": {v["title"]}, "created": 1.5, "system": {v["system"]}, '
        f'"model": {v["model"]}, "turns": [{turn}]}}'
    )


def write(name: str, text: str) -> Path:
    path = store.chats_dir() / name
    path.write_text(text, encoding="utf-8")
    return path


def build(engine: Engine | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gradio: the model is not among the dropdown's choices
        demo = ui.build(engine or Engine(catalog.entries()[0].id))
    return demo, {f.name: f.fn for f in demo.fns.values()}


# -- every string valid Unicode -----------------------------------------------------------------

PLACES = ["title", "system", "model", "user", "assistant", "step", "finish_reason", "mode"]


@pytest.mark.parametrize("place", PLACES)
def test_a_lone_surrogate_anywhere_sets_the_chat_aside_and_the_rest_loads(home, place):
    """Old: the chat loaded, and its title (or any text) broke every page that showed it."""
    write(f"{OTHER}.json", chat_json(OTHER))
    planted = write(f"{ID}.json", chat_json(**{place: f'"a{SURROGATE}b"'}))
    before = planted.read_bytes()
    said = [f"A damaged chat file was set aside as {ID}.corrupt."]
    for listing, problems_said in (("list_chats", said), ("list_entries", [])):  # reading each, then the index
        chats, problems = getattr(store, listing)()
        assert [c.id for c in chats] == [OTHER] and problems == problems_said
    assert (store.chats_dir() / f"{ID}.corrupt").read_bytes() == before  # nothing lost


def test_a_file_name_that_is_not_utf8_is_named_in_valid_unicode(home):
    """Old: the message held the name as Python reads it, with a lone surrogate (U+DCFF) that
    could not be sent to the page."""
    with open(os.path.join(os.fsencode(store.chats_dir()), b"\xff.json"), "wb") as f:
        f.write(b"{}")
    message = "A damaged chat file was set aside as \\udcff.corrupt."
    assert ui_session.chat_choices() == ([], [message]) and message.encode("utf-8")


def test_the_app_starts_with_a_lone_surrogate_title(home):
    """Old: `/` and `/config` answered 500 on every load; nothing was set aside."""
    import gradio as gr
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    write(f"{OTHER}.json", chat_json(OTHER, '"Kept"'))
    write(f"{ID}.json", chat_json(title=f'"{SURROGATE}"'))
    demo, handlers = build()
    with TestClient(gr.mount_gradio_app(FastAPI(), demo, path="/"), raise_server_exceptions=False) as client:
        page, config = client.get("/"), client.get("/config")
    assert page.status_code == 200 and config.status_code == 200
    assert "Kept" in config.text and ID not in config.text
    with pytest.warns(UserWarning) as said:
        handlers["on_load"](None)  # the first page load tells what was found at start
    assert [str(w.message) for w in said] == [f"A damaged chat file was set aside as {ID}.corrupt."]
    assert (store.chats_dir() / f"{ID}.corrupt").exists() and not (store.chats_dir() / f"{ID}.json").exists()


def test_what_is_written_is_always_valid_unicode(home):
    """Old: save_chat raised UnicodeEncodeError (the turn was lost); settings were written with
    the surrogate escaped, and read back into a page that could not be sent."""
    bad = "a\ud800b"
    chat = store.Chat(ID, bad, 1.0, bad, bad, [store.Turn(bad, bad, [(bad, 0, "")], {}, False)])
    store.save_chat(chat)
    text = store.chat_path(ID).read_bytes().decode("utf-8")  # strict: no surrogate escapes either
    assert "\\ud800" not in text
    loaded = store.load_chat(ID)
    assert loaded.title == loaded.system == loaded.turns[0].user == loaded.turns[0].steps[0][0] == "a\ufffdb"
    assert store.list_entries() == ([store.ChatEntry(ID, "a\ufffdb", 1.0)], [])
    store.save_settings({"system": bad, "epsilon": 0.2})
    assert "\\ud800" not in store.settings_file().read_text(encoding="utf-8")
    assert store.load_settings() == {"system": "a\ufffdb", "epsilon": 0.2}


def test_a_title_typed_with_a_surrogate_is_cleaned(home):
    """Old: rename stored the surrogate; saving the chat raised UnicodeEncodeError."""
    _, handlers = build()
    session = handlers["new_chat"](None, True)[1]
    session.chat.turns.append(store.Turn("hi"))
    choices, session = handlers["rename"]("x\udfffy", session)
    assert session.chat.title == "x\ufffdy" and store.load_chat(session.chat.id).title == "x\ufffdy"
    assert choices["choices"] == [("x\ufffdy", session.chat.id)]


# -- symbolic links -------------------------------------------------------------------------------


def test_a_symbolic_link_named_like_a_chat_is_never_followed(home):
    """Old: a link to a file outside the chats folder was read as a chat."""
    outside = home / "outside.json"
    outside.write_text(chat_json(title='"Planted"'))
    link = store.chats_dir() / f"{ID}.json"
    link.symlink_to(outside)
    write(f"{OTHER}.json", chat_json(OTHER))
    chats, problems = store.list_chats()
    assert [c.id for c in chats] == [OTHER] and problems == [f"A damaged chat file was set aside as {ID}.corrupt."]
    assert (store.chats_dir() / f"{ID}.corrupt").is_symlink()  # the link was moved, its target left alone
    assert outside.read_text() == chat_json(title='"Planted"')
    link.symlink_to(outside)
    with pytest.raises(store.ChatFileError, match="symbolic link"):
        store.load_chat(ID)
    entries, problems = store.list_entries()
    assert [c.id for c in entries] == [OTHER] and problems == [f"A damaged chat file was set aside as {ID}.1.corrupt."]


# -- the chat list from an index ------------------------------------------------------------------


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The names of the chat files read from now on."""
    seen: list[str] = []
    real = store._read_file

    def spy(file: Path):
        if file.parent == store.chats_dir():
            seen.append(file.name)
        return real(file)

    monkeypatch.setattr(store, "_read_file", spy)
    return seen


def saved_chats(n: int) -> list[store.Chat]:
    chats = []
    for i in range(n):
        chat = store.Chat(f"{i:012x}", f"Chat {i}", 100.0 + i, turns=[store.Turn("hi", "x" * 1000 * i, [], {}, False)])
        store.save_chat(chat)
        chats.append(chat)
    return chats


def test_a_page_load_reads_no_chat_file(home, reads):
    """Old: every page load read (and kept in memory) every chat file."""
    chats = saved_chats(5)
    big = store.Chat(OTHER, "Big", 1.0, turns=[store.Turn("hi", "y" * 5_000_000, [], {}, True)])
    store.save_chat(big)
    choices, problems = ui_session.chat_choices()  # what the page load and every chat-list update call
    assert reads == [] and problems == []
    assert choices == [(c.title, c.id) for c in reversed(chats)] + [("Big", OTHER)]


def test_the_chat_list_does_not_open_a_chat_the_index_knows(home):
    """A file overwritten in place behind the index's back, with its size and time kept (which
    nothing but a test does), is listed as indexed: proof that listing does not open it.
    Old: every listing read it (and here set it aside)."""
    chats = saved_chats(2)
    assert ui_session.chat_choices() == ([("Chat 1", chats[1].id), ("Chat 0", chats[0].id)], [])
    file = store.chat_path(chats[0].id)
    st = file.stat()
    with open(file, "r+b") as f:
        f.write(b"#" * st.st_size)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ui_session.chat_choices() == ([("Chat 1", chats[1].id), ("Chat 0", chats[0].id)], [])


def test_the_index_heals_itself(home, reads):
    """The index follows saves, renames and deletes; a chat added, changed or removed behind its
    back, or an index lost or damaged, is found from the folder's listing."""
    chats = saved_chats(4)
    store.delete_chat(chats[3].id)
    chats[2].title = "Renamed"
    store.save_chat(chats[2])
    assert [c.title for c in store.list_entries()[0]] == ["Renamed", "Chat 1", "Chat 0"] and reads == []
    write(f"{ID}.json", chat_json())  # added by hand, or by another copy of the app
    store.chat_path(chats[0].id).unlink()
    write(f"{chats[1].id}.json", chat_json(chats[1].id, '"Edited"'))
    entries, problems = store.list_entries()
    assert problems == [] and sorted(reads) == sorted([f"{ID}.json", f"{chats[1].id}.json"])
    expected = [("Renamed", chats[2].id), ("Edited", chats[1].id), ("Greetings", ID)]
    assert [(e.title, e.id) for e in entries] == expected
    reads.clear()
    assert store.list_entries()[0] == entries and reads == []
    for damage in ("{not json", '{"version": 1, "chats": {"0123456789ab": {"title": 3}}}', None):
        if damage is None:
            store.index_file().unlink()
        else:
            store.index_file().write_text(damage)
        assert store.list_entries() == (entries, [])
    assert json.loads(store.index_file().read_text())["version"] == store.INDEX_VERSION


def test_past_replies_are_read_one_chat_at_a_time_and_damage_is_left_for_the_chat_list(home):
    """Old: saved_replies (the retrieval drafter's corpus, read as the model loads) held every
    chat in memory at once, and set damaged files aside unreported."""
    write(f"{OTHER}.json", chat_json(OTHER, assistant='"kept reply"'))
    write(f"{ID}.json", "{not json")
    assert store.saved_replies() == ["kept reply"]
    assert ui_session.chat_choices()[1] == [f"A damaged chat file was set aside as {ID}.corrupt."]


# -- the user's message saved before its reply ------------------------------------------------------


class Killed(BaseException):
    """The process dying mid-reply: nothing after it runs, no handler catches it."""


class KilledAtFirstStep(Engine):
    """An engine whose reply dies at its first step, noting what the disk held at that moment."""

    def __init__(self) -> None:
        super().__init__(catalog.entries()[0].id)
        self.on_disk: list[store.Chat] = []

    def reply(self, request, should_stop=lambda: False) -> Reply:
        def events():
            self.on_disk = store.list_chats()[0]
            yield StepEvent(1, (5,), "Hel", 0, (0,), (), 0, 0.01, 100.0)
            raise Killed
            yield Finished((5,), "Hel", 1, 0.01, 0.01, "eos")  # never reached

        return Reply([1, 2], "", 0, None, None, 0, events())


@pytest.mark.parametrize(("message", "saved"), [("Write a poem\nabout rivers.",) * 2, ("a\udc80b", "a\ufffdb")])
def test_a_kill_during_the_reply_loses_none_of_the_users_message(home, message, saved):
    """Old: the turn was saved only when its reply ended: a kill lost the message."""
    engine = KilledAtFirstStep()
    _, handlers = build(engine)
    with pytest.raises(Killed):
        for _ in handlers["send"](message, None, *CONTROLS):
            pass
    assert [[t.user for t in c.turns] for c in engine.on_disk] == [[saved]]  # before the first step
    chats, problems = store.list_chats()
    assert problems == [] and chats[0].turns == [store.Turn(saved)] and chats[0].title == saved.splitlines()[0]
    assert ui_session.chat_choices() == ([(saved.splitlines()[0], chats[0].id)], [])
