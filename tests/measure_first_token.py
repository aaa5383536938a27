"""A manual measurement, not a test (pytest does not collect it): time to first token through the
local API, a fresh one-message chat against the next turn of a ~3,000-token conversation.

    python -m tests.measure_first_token [--context 3000] [--turns 3] [--mode medusa|baseline]

The server runs in this process on the embedded model, as `medusa-chat ui` serves it. Each time is
the client's: from sending the request to the first streamed text. The fresh chat is asked with
nothing kept (the engine's kept cache cleared first), the way every turn began before the cache was
kept. The conversation's turns go on as a client would: each sends the whole history, the last
reply as the model wrote it. Every reply of the conversation is asked again with nothing kept and
must be the same text. Run it on an idle machine; the numbers go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import httpx

from models.embedded import EMBEDDED_ID

QUESTIONS = ("Name three colors.", "What is the capital of France?", "Give me a word that rhymes with cat.")


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


def main() -> None:
    from app.engine import Engine
    from app.server import start
    from core.decode.settings import DecodeSettings
    from tests.test_api import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=3000, help="tokens of conversation before the measured turns")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--mode", default="medusa", choices=("medusa", "baseline"))
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    home = tempfile.mkdtemp(prefix="medusa-ttf-")  # the chat page's chats and settings: none of the user's
    os.environ |= {"XDG_DATA_HOME": f"{home}/data", "XDG_CONFIG_HOME": f"{home}/config"}

    engine = Engine(EMBEDDED_ID)
    engine.start().result()
    if engine.error:
        raise SystemExit(engine.error)
    server = start(engine, "127.0.0.1", free_port())
    try:
        url = server.url

        def count(messages: list[dict]) -> int:
            return len(engine.prepare([*messages, {"role": "user", "content": "x"}], "", DecodeSettings()).ids)

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
    finally:
        server.close()
        engine.close()


if __name__ == "__main__":
    main()
