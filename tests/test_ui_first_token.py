"""A long chat stays fast on the chat page (issue 34): the conversation's cache is kept between
turns, so the next turn reads only what it adds, and the reply's stats say so.

The embedded model served in this process, as `medusa-chat ui` serves it, and Chromium driving the
page. A saved chat of about 1,600 tokens is opened from the chat list; its first new turn reads the
whole conversation, the next only the last reply's end and the new message, a regenerated reply
only the prompt's last token, and a new chat all of its prompt but the chat template's opening
lines (the system prompt the old conversation began with too). Counts, not times: the times are
`python -m tests.measure_first_token --ui`'s.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from playwright.sync_api import sync_playwright

from app import store
from app.engine import Engine
from app.ui_session import conversation
from core.decode.settings import DecodeSettings
from core.sequences import common_prefix
from models.embedded import EMBEDDED_ID
from tests.measure_first_token import (
    LONG_CHAT,
    Shown,
    counter,
    history,
    new_chat,
    open_chat,
    open_page,
    plant_chat,
    plant_settings,
    reply,
)
from tests.test_api import free_port
from tests.test_ui import BROWSER_ARGS, CHROMIUM

pytestmark = [
    pytest.mark.embedded,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (.ci/run installs it)"),
]
CONTEXT = 1600  # tokens of the saved conversation
MAX_NEW = 16  # each reply's length limit, set through the page's saved settings
SETTINGS = DecodeSettings(max_new_tokens=MAX_NEW)
READ_AT_MOST = 40  # prompt tokens the next turn may read: the last reply's last token, the new message's lines


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The chat page on the embedded model, with greedy short replies and a long chat saved."""
    from app.server import start

    home = tmp_path_factory.mktemp("first-token")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(home / "data"))
        mp.setenv("XDG_CONFIG_HOME", str(home / "config"))
        engine = Engine(EMBEDDED_ID, past_replies=store.saved_replies)
        engine.start().result()
        assert engine.error is None, engine.error
        plant_settings(MAX_NEW)  # before the page is built: it starts from the saved settings
        chat = plant_chat(history(CONTEXT, counter(engine)), EMBEDDED_ID)
        server = start(engine, "127.0.0.1", free_port())
        try:
            yield SimpleNamespace(url=server.url, engine=engine, chat=chat)
        finally:
            server.close()
            engine.close()


def prompt(engine: Engine, chat_id: str) -> list[int]:
    """The prompt of the saved chat's last turn, as the page asks for it."""
    turns = store.load_chat(chat_id).turns
    return engine.prepare(conversation(turns[:-1], turns[-1].user), "", SETTINGS).ids


def counts(shown: Shown, chat_id: str) -> tuple[int, int]:
    """(prompt tokens read, reused) as the reply's stats show them, checked against the saved turn's."""
    read, reused = shown.count("prompt tokens read"), shown.count("prompt tokens reused")
    saved = store.load_chat(chat_id).turns[-1].stats
    assert (saved["prompt_read"], saved["prompt_reused"]) == (read, reused)  # the stats are this reply's
    assert shown.stats_first_seconds >= 0  # the time to first token is shown beside them
    return read, reused


def test_a_long_chats_next_turn_reads_only_what_it_adds(served):
    engine, chat_id, turns = served.engine, served.chat.id, len(served.chat.turns)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        page = open_page(browser, served.url)
        open_chat(page, LONG_CHAT, turns)

        first = reply(page, message="Name three colors.")
        read, reused = counts(first, chat_id)
        one = prompt(engine, chat_id)
        assert len(one) >= CONTEXT and read + reused == len(one)
        assert read >= 0.9 * len(one)  # the chat was opened: nothing of it was kept

        second = reply(page, message="What is the capital of France?")
        read, reused = counts(second, chat_id)
        two = prompt(engine, chat_id)
        assert read + reused == len(two) and two[: len(one)] == one
        assert reused >= len(one) and reused >= 0.9 * len(two)  # the whole last turn's prompt, and more
        assert 0 < read <= READ_AT_MOST, (read, reused)

        again = reply(page, "#regenerate")
        read, reused = counts(again, chat_id)
        assert prompt(engine, chat_id) == two  # the same prompt, its reply asked again
        assert read + reused == len(two) and read <= 2, (read, reused)  # its last token (EAGLE: one more)

        new_chat(page)
        message = "Give me a word that rhymes with cat."
        fresh = reply(page, message=message)
        new_id = store.list_chats()[0][0].id  # newest first
        read, reused = counts(fresh, new_id)
        alone = engine.prepare([{"role": "user", "content": message}], "", SETTINGS).ids
        opening = common_prefix(alone, two)  # the chat template's system lines, shared with the old chat
        assert store.load_chat(new_id).turns[0].user == message
        assert read + reused == len(alone) and reused <= opening, (read, reused, opening)
        browser.close()
