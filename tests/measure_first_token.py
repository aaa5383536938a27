"""A manual measurement, not a test (pytest does not collect it): time to first token, a fresh
one-message chat against the next turn of a ~3,000-token conversation, through the local API or,
with --ui, through the chat page in Chromium.

    python -m tests.measure_first_token [--context 3000] [--turns 3] [--mode medusa|baseline] [--ui]

The server runs in this process on the embedded model, as `medusa-chat ui` serves it. Each time is
the client's: through the API from sending the request to the first streamed text; on the page from
the click on Send to the first streamed token shown in the chat (timed by the page itself), beside
the time the reply's stats give (the engine's, from the request reaching the model thread). The
fresh chat is asked with nothing kept (the engine's kept cache cleared first), the way every turn
began before the cache was kept. Through the API the conversation's turns go on as a client would:
each sends the whole history, the last reply as the model wrote it, and every reply is asked again
with nothing kept and must be the same text. On the page the conversation is a saved chat, opened
from the chat list, and each turn is typed and sent. Run it on an idle machine; the numbers go to
stdout.

The page helpers here (`open_page`, `open_chat`, `reply`, `plant_chat`) also serve
tests/test_ui_first_token.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass

import httpx

from models.embedded import EMBEDDED_ID

QUESTIONS = ("Name three colors.", "What is the capital of France?", "Give me a word that rhymes with cat.")
LONG_CHAT = "A long conversation"  # the planted chat's title, as the chat list shows it


def ask(url: str, messages: list[dict], mode: str, max_tokens: int) -> tuple[float, str, dict]:
    """(seconds to the first streamed text, the reply, the `medusa` figures) of one greedy reply."""
    body = {"model": EMBEDDED_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body |= {"mode": mode}
    first, text, figures = 0.0, "", {}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter() - start
                    text += choice["delta"]["content"]
            figures = chunk.get("medusa", figures)
    return first, text, figures


def history(tokens: int, count) -> list[dict]:
    """Earlier turns of about `tokens` tokens (`count` measures messages): the shipped seed prompts as
    the user's messages, and as the assistant's the prompts after them, a few to a reply."""
    from importlib import resources

    lines = (resources.files("assets") / "prompts" / "seed.jsonl").read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    messages: list[dict] = []
    i = 0
    while count(messages) < tokens:
        messages += [
            {"role": "user", "content": prompts[i]},
            {"role": "assistant", "content": " ".join(prompts[i + 1 : i + 6])},
        ]
        i += 6
    return messages


def counter(engine):
    """How many tokens the prompt of `messages` and one more short user message takes on `engine`."""
    from core.decode.settings import DecodeSettings

    def count(messages: list[dict]) -> int:
        return len(engine.prepare([*messages, {"role": "user", "content": "x"}], "", DecodeSettings()).ids)

    return count


# -- the chat page ----------------------------------------------------------------------------------------------------

# Click `selector` and time, in the page, the click to the first streamed token: the streaming reply's
# cursor, or (a reply done before it was drawn) more step markers than the chat held before.
_CLICK = """(selector) => {
  const chat = document.querySelector('#chat');
  const before = chat.querySelectorAll('[data-step]').length;
  const seen = () => chat.querySelector('.cursor') || chat.querySelectorAll('[data-step]').length > before;
  window.__firstToken = null;
  const observer = new MutationObserver(() => {
    if (window.__firstToken === null && seen()) {
      window.__firstToken = performance.now() - window.__clicked;
      observer.disconnect();
    }
  });
  observer.observe(chat, {childList: true, subtree: true, characterData: true});
  window.__clicked = performance.now();
  document.querySelector(selector).click();
}"""
_DONE = "window.__firstToken !== null && !document.querySelector('#chat .cursor')"
_STATS = """() => Object.fromEntries([...document.querySelectorAll('#stats tr')]
  .map(r => [r.querySelector('th').innerText.trim(), r.querySelector('td').innerText.trim()]))"""


@dataclass(frozen=True)
class Shown:
    """One reply as the page showed it."""

    first_seconds: float  # from the click to the first streamed token in the chat
    stats: dict[str, str]  # the reply's stats panel, label → value as shown

    def count(self, label: str) -> int:
        """A count from the stats ("prompt tokens read"); a ValueError naming it where the stats lack it."""
        value = self.stats.get(label, "")
        if not value.isdigit():
            raise ValueError(f"the reply's stats show no '{label}' count: {self.stats}")
        return int(value)

    @property
    def stats_first_seconds(self) -> float:
        """The stats' own time to first token (shown in whole milliseconds)."""
        shown = re.fullmatch(r"(\d+) ms", self.stats.get("first token", ""))
        if shown is None:
            raise ValueError(f"the reply's stats show no first-token time: {self.stats}")
        return int(shown[1]) / 1000


def open_page(browser, url: str, timeout_ms: int = 120_000):
    """A new tab on the chat page, once its status line says the model is ready."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.wait_for_function(
        "(document.querySelector('#status')?.innerText || '').includes('Ready:')", timeout=timeout_ms
    )
    return page


def open_chat(page, title: str, turns: int) -> None:
    """Open the saved chat `title` from the chat list, and wait until its `turns` messages are shown."""
    page.locator("#chat-list label", has_text=title).click()
    page.wait_for_function(f"document.querySelectorAll('#chat .medusa-user').length === {turns}", timeout=60_000)


def new_chat(page) -> None:
    page.get_by_role("button", name="New chat").click()
    page.wait_for_function("document.querySelectorAll('#chat .medusa-user').length === 0", timeout=60_000)


def reply(page, button: str = "#send", message: str | None = None, timeout_ms: int = 300_000) -> Shown:
    """Type `message` (None: nothing), click `button` (#send, #regenerate) and wait for the whole reply."""
    if message is not None:
        page.locator("#msg textarea").fill(message)
    page.evaluate(_CLICK, button)
    page.wait_for_function(_DONE, timeout=timeout_ms)
    return Shown(page.evaluate("window.__firstToken") / 1000, page.evaluate(_STATS))


def plant_chat(messages: list[dict], model: str, title: str = LONG_CHAT):
    """Save `messages` (user, assistant, user, …) as a finished chat in the chat store, for the page to open."""
    from app import store

    chat = store.Chat.new(model)
    chat.title = title
    chat.turns = [
        store.Turn(u["content"], a["content"], finished=True)
        for u, a in zip(messages[::2], messages[1::2], strict=True)
    ]
    store.save_chat(chat)
    return chat


def plant_settings(max_new_tokens: int, decoding: str = "Medusa") -> None:
    """The page's starting settings: greedy, `max_new_tokens`, `decoding` ("Medusa" or "Plain")."""
    from app import store
    from app.controls import DEFAULTS

    store.save_settings(DEFAULTS | {"temperature": 0.0, "max_new_tokens": max_new_tokens, "decoding": decoding})


# -- the two measurements --------------------------------------------------------------------------------------------


def measure_api(engine, url: str, args: argparse.Namespace) -> None:
    count = counter(engine)
    ask(url, [{"role": "user", "content": "Hello!"}], args.mode, 8)  # warm up
    fresh = []
    for q in QUESTIONS:
        engine.kept.clear()
        seconds, _, figures = ask(url, [{"role": "user", "content": q}], args.mode, args.max_tokens)
        fresh.append(seconds)
        print(f"fresh one-message chat: {1000 * seconds:7.1f} ms to first token, read {figures['prompt_read']}")
    chat = history(args.context, count)
    rows, same = [], True
    for turn in range(args.turns + 1):
        chat.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        seconds, text, figures = ask(url, chat, args.mode, args.max_tokens)
        read, reused = figures["prompt_read"], figures["prompt_reused"]
        label = "first turn (nothing shared)" if turn == 0 else f"next turn {turn}"
        print(f"{label:<28}: {1000 * seconds:7.1f} ms to first token, read {read}, reused {reused}")
        if turn:
            rows.append(seconds)
        engine.kept.clear()  # the same turn with nothing kept, which then keeps it as the turn left it
        same &= ask(url, chat, args.mode, args.max_tokens)[1] == text
        chat.append({"role": "assistant", "content": text})
    base, mine = statistics.median(fresh), statistics.median(rows)
    print(
        f"\nmedian time to first token: fresh one-message chat {1000 * base:.1f} ms, next turn of a "
        f"{count(chat[:-1])}-token conversation {1000 * mine:.1f} ms ({mine / base:.2f}×); "
        f"replies the same with nothing kept: {'yes' if same else 'NO'}"
    )


def _line(label: str, shown: Shown) -> str:
    read, reused = shown.count("prompt tokens read"), shown.count("prompt tokens reused")
    return (
        f"{label:<28}: {1000 * shown.first_seconds:7.1f} ms to first token on the page, "
        f"{1000 * shown.stats_first_seconds:5.0f} ms in the stats, read {read}, reused {reused}"
    )


def measure_ui(engine, url: str, args: argparse.Namespace, turns: int) -> None:
    from playwright.sync_api import sync_playwright

    from tests.test_ui import BROWSER_ARGS, CHROMIUM

    if not os.path.exists(CHROMIUM):
        raise SystemExit(f"--ui drives Chromium, and {CHROMIUM} is not installed (apt-get install chromium).")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        page = open_page(browser, url)
        reply(page, message="Hello!")  # warm up
        fresh = []
        for q in QUESTIONS:
            new_chat(page)
            engine.compute.call(engine.kept.clear)  # on the model thread, between replies
            fresh.append(reply(page, message=q))
            print(_line("fresh one-message chat", fresh[-1]))
        open_chat(page, LONG_CHAT, turns)
        rows = []
        for turn in range(args.turns + 1):
            shown = reply(page, message=QUESTIONS[turn % len(QUESTIONS)])
            print(_line("first turn (nothing shared)" if turn == 0 else f"next turn {turn}", shown))
            rows += [shown] if turn else []
        browser.close()
    size = rows[-1].count("prompt tokens read") + rows[-1].count("prompt tokens reused")  # the last turn's prompt
    print()
    for what, time_of in (("on the page", "first_seconds"), ("in the stats", "stats_first_seconds")):
        base = statistics.median(getattr(s, time_of) for s in fresh)
        mine = statistics.median(getattr(s, time_of) for s in rows)
        print(
            f"median time to first token {what}: fresh one-message chat {1000 * base:.1f} ms, next turn of a "
            f"{size}-token conversation {1000 * mine:.1f} ms ({mine / base:.2f}×)"
        )


def main() -> None:
    from app.engine import Engine
    from app.server import start
    from app.store import saved_replies
    from tests.test_api import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=3000, help="tokens of conversation before the measured turns")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--mode", default="medusa", choices=("medusa", "baseline"))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ui", action="store_true", help="through the chat page in Chromium, not the API")
    args = p.parse_args()
    if args.turns < 1 or args.context < 1 or args.max_tokens < 1:
        p.error("--turns, --context and --max-tokens must be at least 1")
    home = tempfile.mkdtemp(prefix="medusa-ttf-")  # the chat page's chats and settings: none of the user's
    os.environ |= {"XDG_DATA_HOME": f"{home}/data", "XDG_CONFIG_HOME": f"{home}/config"}

    engine = Engine(EMBEDDED_ID, past_replies=saved_replies if args.ui else None)  # the page's: as `medusa-chat ui`
    engine.start().result()
    if engine.error:
        raise SystemExit(engine.error)
    if args.ui:  # before the page is built: it starts from the saved settings and lists the saved chats
        plant_settings(args.max_tokens, "Medusa" if args.mode == "medusa" else "Plain")
        turns = len(plant_chat(history(args.context, counter(engine)), EMBEDDED_ID).turns)
    server = start(engine, "127.0.0.1", free_port())
    try:
        if args.ui:
            measure_ui(engine, server.url, args, turns)
        else:
            measure_api(engine, server.url, args)
    finally:
        server.close()
        engine.close()


if __name__ == "__main__":
    main()
