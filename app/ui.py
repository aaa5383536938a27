"""The Gradio chat: layout and event handlers. No decoding logic and no module-level state.

Everything per user lives in a `Session` held by `gr.State`; the loaded model is the
`Engine` passed to `build`. The user's message is saved before its reply starts, and the turn
again, atomically, as soon as it ends (or is stopped).
"""

from __future__ import annotations

import html
import logging
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import gradio as gr

from app import store
from app.controls import ACCEPTANCE, DECODING, DEFAULTS, NAMES, Controls
from app.engine import MODEL_TREE, Engine, figures
from app.render import LEGEND, depth_rates, reply_html, stats_html, step_source, text_html, tree_html
from core.decode.generate import Finished, StepEvent
from core.decode.tree import AUTO, DRAFT_SOURCES, preset_names
from core.errors import UserError
from models import catalog

log = logging.getLogger("medusa-chat")


@dataclass
class Session:
    chat: store.Chat
    stop: threading.Event = field(default_factory=threading.Event)
    events: list[StepEvent] = field(default_factory=list)  # the last reply's steps
    max_depth: int = 0
    prompt: list[int] = field(default_factory=list)  # the last reply's prompt ids (for Compare)
    medusa_stats: dict = field(default_factory=dict)


def _session(s: Session | None, engine: Engine) -> Session:
    return s if s is not None else Session(store.Chat.new(engine.model_id))


def _messages(chat: store.Chat, colors: bool) -> list[dict]:
    out = []
    for t in chat.turns:
        out.append({"role": "user", "content": text_html(t.user)})
        if t.steps or t.assistant:
            out.append({"role": "assistant", "content": reply_html(t.steps or [(t.assistant, 0)], colors)})
    return out


def _chat_choices() -> tuple[list[tuple[str, str]], list[str]]:
    chats, problems = store.list_entries()  # from the index: a page load reads no chat file
    return [(c.title, c.id) for c in chats], problems


def _stats(stats: dict, events: list[StepEvent], max_depth: int) -> str:
    accepted = [e.accepted for e in events]
    return stats_html(stats, accepted, depth_rates(accepted, max_depth))


def _model_choices() -> list[tuple[str, str]]:
    from models.hub import cached_state

    out = []
    for e in catalog.entries():
        if e.embedded:
            state = "embedded"
        else:
            cached = cached_state(e.sources)
            state = "cached" if cached == "cached" else f"{e.download_gb:.1f} GB download"
        out.append((f"{e.name} · {state} · ~{e.memory_gb_4bit:.1f} GB at 4-bit", e.id))
    return out


def build(engine: Engine) -> gr.Blocks:
    saved = DEFAULTS | store.load_settings()
    trees = preset_names()
    chats, startup_problems = _chat_choices()  # damaged files found now are reported on the first page load

    with gr.Blocks(title="medusa-chat") as demo:
        session = gr.State(None)
        with gr.Sidebar(open=True):
            gr.Markdown("### Chats")
            new_btn = gr.Button("New chat", variant="secondary")
            chat_list = gr.Radio(choices=chats, label="Past chats", elem_id="chat-list")
            title = gr.Textbox(label="Title", placeholder="Rename this chat")
            with gr.Row():
                rename_btn = gr.Button("Rename", size="sm")
                delete_btn = gr.Button("Delete", size="sm", variant="stop")
            export_btn = gr.DownloadButton("Export as Markdown", size="sm")

        with gr.Row():
            with gr.Column(scale=3):
                status = gr.Markdown(engine.status(), elem_id="status")
                # sanitize_html=False: every message is app.render's output, with raw HTML escaped
                chatbot = gr.Chatbot(
                    elem_id="chat", height=560, buttons=[], sanitize_html=False, group_consecutive_messages=False
                )
                gr.HTML(LEGEND)
                with gr.Row():
                    msg = gr.Textbox(placeholder="Message", show_label=False, scale=5, elem_id="msg", autofocus=True)
                    send_btn = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                with gr.Row():
                    stop_btn = gr.Button("Stop", elem_id="stop")
                    regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                    compare_btn = gr.Button("Compare with plain decoding", elem_id="compare")
                compare_out = gr.HTML(elem_id="compare-out")
            with gr.Column(scale=2):
                with gr.Accordion("Decoding", open=True):
                    decoding = gr.Radio(list(DECODING), value=saved["decoding"], label="Decoding", elem_id="decoding")
                    acceptance = gr.Radio(
                        ACCEPTANCE, value=saved["acceptance"], label="Acceptance", elem_id="acceptance",
                        info="Lossless keeps the model's own output; Typical accepts plausible drafts for speed",
                    )  # fmt: skip
                    typical = saved["acceptance"] == ACCEPTANCE[1]  # "Typical"
                    epsilon = gr.Slider(
                        0.01, 1.0, value=saved["epsilon"], step=0.01, interactive=typical, elem_id="epsilon",
                        label="ε: accept a draft whose probability exceeds this (or δ·e^−H, whichever is lower)",
                    )  # fmt: skip
                    delta = gr.Slider(
                        0.01, 1.0, value=saved["delta"], step=0.01, interactive=typical, elem_id="delta",
                        label="δ: entropy-scaled threshold; lower accepts more when the model is unsure",
                    )  # fmt: skip
                    temperature = gr.Slider(
                        0.0, 2.0, value=saved["temperature"], step=0.05, label="Temperature (0 = greedy)"
                    )
                    top_p = gr.Slider(0.05, 1.0, value=saved["top_p"], step=0.05, label="Top-p")
                    max_new = gr.Slider(16, 2048, value=saved["max_new_tokens"], step=16, label="Max new tokens")
                    tree = gr.Dropdown(
                        [("Auto: chosen each step for this machine", AUTO),
                         ("The model's calibrated tree", MODEL_TREE), *trees],
                        value=saved["tree"] or AUTO, label="Tree", elem_id="tree",
                        info="Auto prices every tree (plain decoding included) with this machine's measured costs",
                    )  # fmt: skip
                    drafter = gr.Dropdown(
                        [("The tree's own", ""), ("Heads + context + past replies (hybrid)", "hybrid"),
                         ("Medusa heads", "medusa"), ("Context lookup", "lookup"), ("Past replies", "retrieval"),
                         ("EAGLE layer + context + past replies", "eagle")],
                        value=saved["drafter"], label="Drafter", elem_id="drafter",
                        info="Where drafts come from: the heads, copies from the conversation or from the model's "
                        "past replies, all in one tree, or the EAGLE draft layer",
                    )  # fmt: skip
                    colors = gr.Checkbox(value=saved["colors"], label="Color the tokens of each step", elem_id="colors")
                    system = gr.Textbox(value=saved["system"], label="System prompt", lines=2)
                with gr.Accordion("Model", open=False):
                    model = gr.Dropdown(_model_choices(), value=engine.model_id, label="Model", elem_id="model")
                    model_info = gr.Markdown()
                    load_btn = gr.Button("Download and load")
                with gr.Accordion("Reply stats", open=True):
                    stats = gr.HTML(stats_html({}, [], []), elem_id="stats")
                with gr.Accordion("Step inspector", open=False):
                    step_pick = gr.Slider(1, 2, value=1, step=1, label="Step of the last reply")
                    inspector = gr.HTML()

        named = {
            "system": system, "decoding": decoding, "acceptance": acceptance, "epsilon": epsilon, "delta": delta,
            "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new, "tree": tree, "drafter": drafter,
            "colors": colors,
        }  # fmt: skip
        controls = [named[name] for name in NAMES]  # a handler's `*values`; Controls.of names them again

        # -- helpers bound to this engine -------------------------------------------------

        def run_turn(s: Session, c: Controls):
            """Stream the reply to the chat's last turn; save it when it ends."""
            turn = s.chat.turns[-1]
            s.stop.clear()
            reply = engine.reply(c.request(_conversation(s.chat.turns[:-1], turn.user)), s.stop.is_set)
            if reply.note:
                gr.Warning(reply.note)
            s.events, s.max_depth, s.prompt = [], reply.depth, reply.prompt_ids
            sources = dict.fromkeys(DRAFT_SOURCES, 0)
            for e in reply.events:
                if isinstance(e, Finished):
                    turn.assistant, turn.finished = e.text, e.finish_reason != "cancelled"
                    turn.stats = figures(e) | {
                        "mode": c.decoding, "acceptance": c.acceptance, "tree": reply.tree, "drafter": reply.drafter,
                        "sources": sources,
                    }  # fmt: skip
                    s.medusa_stats = turn.stats
                    s.chat.model = engine.model_id
                    store.save_chat(s.chat)
                    yield _messages(s.chat, c.colors), _stats(turn.stats, s.events, reply.depth), True
                    return
                s.events.append(e)
                for k in e.sources:
                    sources[k] += 1
                turn.steps.append((e.text, e.accepted, step_source(e.sources)))
                yield (
                    _messages(s.chat, c.colors)[:-1]
                    + [{"role": "assistant", "content": reply_html(turn.steps, c.colors, streaming=True)}],
                    gr.skip(),
                    False,
                )

        def finish_outputs(s: Session):
            choices, _ = _chat_choices()
            n = max(len(s.events), 2)
            return gr.update(choices=choices, value=s.chat.id), gr.update(maximum=n, value=1), s.chat.title

        # -- events ----------------------------------------------------------------------

        def send(message, s, *values):
            s, c = _session(s, engine), Controls.of(values)
            if not message or not message.strip():
                gr.Warning("Type a message first.")
                yield gr.skip(), s, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
                return
            message = store.clean_text(message)  # a lone surrogate sent through the API cannot be saved
            try:  # a bad setting or a message that cannot fit is refused before the turn is stored
                engine.reply(c.request(_conversation(s.chat.turns, message)))  # runs nothing until its events are read
            except UserError as e:
                gr.Warning(str(e))
                yield gr.skip(), s, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
                return
            if problem := _begin_turn(s, message, engine.model_id):
                gr.Warning(problem)
                yield gr.skip(), s, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
                return
            yield from _stream_turn(s, c)

        def _stream_turn(s: Session, c: Controls):
            try:
                for chat_value, stats_value, done in run_turn(s, c):
                    if done:
                        yield (chat_value, s, "", stats_value, *finish_outputs(s))
                    else:
                        yield chat_value, s, "", stats_value, gr.skip(), gr.skip(), gr.skip()
            except UserError as e:
                gr.Warning(str(e))
                _save_partial(s)
                yield _messages(s.chat, c.colors), s, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
            except Exception as e:
                log.exception("generation failed")
                gr.Warning(f"Generation failed ({type(e).__name__}: {e}); details are in the log.")
                _save_partial(s)
                yield _messages(s.chat, c.colors), s, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()

        def regenerate(s, *values):
            s, c = _session(s, engine), Controls.of(values)
            if not s.chat.turns:
                gr.Warning("Nothing to regenerate yet.")
                yield gr.skip(), s, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
                return
            last = s.chat.turns[-1]
            s.chat.turns[-1] = store.Turn(user=last.user)
            yield from _stream_turn(s, c)

        def stop(s):
            if s is not None:
                s.stop.set()

        gen_outputs = [chatbot, session, msg, stats, chat_list, step_pick, title]
        common = {"concurrency_id": "generate", "concurrency_limit": 1}
        send_btn.click(send, [msg, session, *controls], gen_outputs, api_name="send", **common)
        msg.submit(send, [msg, session, *controls], gen_outputs, api_name=False, **common)
        regen_btn.click(regenerate, [session, *controls], gen_outputs, api_name="regenerate", **common)
        stop_btn.click(stop, [session], None, api_name="stop", queue=False)

        def new_chat(s, col):
            s = _session(s, engine)
            s.chat, s.events = store.Chat.new(engine.model_id), []
            return [], s, gr.update(value=None), "", stats_html({}, [], [])

        new_btn.click(new_chat, [session, colors], [chatbot, session, chat_list, title, stats], api_name="new_chat")

        def open_chat(chat_id, s, col):
            s = _session(s, engine)
            if not chat_id:
                return gr.skip(), s, gr.skip(), gr.skip(), gr.skip()
            try:  # the file is checked field by field, so what loads also renders
                chat = store.load_chat(chat_id)
            except store.ChatIdError as e:
                gr.Warning(str(e))
                return gr.skip(), s, gr.skip(), gr.skip(), gr.skip()
            except (OSError, ValueError, TypeError, KeyError) as e:
                gr.Warning(store.set_aside(chat_id, e))  # names the file it was moved to
                choices, _ = _chat_choices()
                return gr.skip(), s, gr.skip(), gr.skip(), gr.update(choices=choices, value=None)
            s.chat, s.events = chat, []
            last = chat.turns[-1].stats if chat.turns else {}
            return _messages(chat, col), s, chat.title, stats_html(last, [], []), gr.skip()

        chat_list.input(open_chat, [chat_list, session, colors], [chatbot, session, title, stats, chat_list])

        def rename(new_title, s):
            s = _session(s, engine)
            new_title = store.clean_title(new_title)  # None when the API sends no title
            if not new_title:
                gr.Warning("Type a title first.")
                return gr.skip(), s
            s.chat.title = new_title
            if s.chat.turns:
                store.save_chat(s.chat)
            choices, _ = _chat_choices()
            return gr.update(choices=choices, value=s.chat.id if s.chat.turns else None), s

        rename_btn.click(rename, [title, session], [chat_list, session])

        def delete(s):
            s = _session(s, engine)
            try:
                store.delete_chat(s.chat.id)
            except (OSError, UserError) as e:  # a read-only folder; a bad id cannot reach a path
                gr.Warning(f"The chat could not be deleted: {e}")
                return gr.skip(), s, gr.skip(), gr.skip()
            s.chat, s.events = store.Chat.new(engine.model_id), []
            choices, _ = _chat_choices()
            return [], s, gr.update(choices=choices, value=None), ""

        delete_btn.click(delete, [session], [chatbot, session, chat_list, title])

        def export(s):
            s = _session(s, engine)
            folder = Path(tempfile.mkdtemp(prefix="medusa-chat-export-"))
            path = folder / store.export_name(s.chat.title)
            path.write_text(s.chat.to_markdown(), encoding="utf-8")
            return str(path)

        export_btn.click(export, [session], export_btn)

        def recolor(s, col):
            return _messages(s.chat, col) if s is not None else gr.skip()

        colors.change(recolor, [session, colors], chatbot)

        def toggle_typical(acc):
            on = acc == ACCEPTANCE[1]
            return gr.update(interactive=on), gr.update(interactive=on)

        acceptance.change(toggle_typical, acceptance, [epsilon, delta])

        def remember(*values):
            c = Controls.of(values)
            store.save_settings(asdict(c) | {"tree": _tree_setting(c.tree)})

        for c in controls:
            c.change(remember, controls, None, queue=False)

        def compare(s, *values):
            s, c = _session(s, engine), Controls.of(values)
            if not s.prompt or not s.medusa_stats:
                gr.Warning("Send a message first; the comparison re-runs the last reply without speculation.")
                return gr.skip()
            try:
                *_, done = engine.generate(s.prompt, c.settings(), None, lambda: False)
            except UserError as e:
                gr.Warning(str(e))
                return gr.skip()
            m = s.medusa_stats
            speedup = m["tokens_per_second"] / done.tokens_per_second if done.tokens_per_second else 0
            return (
                f'<div class="medusa-compare"><b>{m["mode"]}</b>: {m["tokens_per_second"]:.1f} tokens/s, '
                f"{m['tokens_per_step']:.2f} tokens/step · <b>Plain</b>: {done.tokens_per_second:.1f} tokens/s, "
                f"1.00 tokens/step · <b>speedup {speedup:.2f}×</b></div>"
            )

        compare_btn.click(compare, [session, *controls], compare_out, api_name="compare", **common)

        def inspect(step, s):
            if s is None or not s.events:
                return "<p>No reply yet.</p>"
            e = s.events[min(int(step), len(s.events)) - 1]
            if not e.draft:
                return f"<p>Step {e.step} is the prefill: the model's first token, no tree.</p>"
            tokens = [engine.token_text(t) for t in e.draft]
            head = f"<p>Step {e.step}: {e.tree_size} candidates verified, {e.accepted} drafted accepted.</p>"
            if e.choice:  # the policy's reason and its expectation, next to what happened
                head += html.escape(
                    f"Policy: {e.choice} (expected {e.expected_tokens:.2f} tokens in {e.expected_ms:.1f} ms; "
                    f"got {len(e.token_ids)} in {1000 * e.seconds:.1f} ms)."
                ).join(("<p>", "</p>"))
            return head + tree_html(e.parents, tokens, e.path, e.node_sources)

        step_pick.change(inspect, [step_pick, session], inspector)

        def describe(model_id):
            entry = catalog.find(model_id)
            if entry is None:
                return ""
            size = "ships with the app" if entry.embedded else f"~{entry.download_gb:.1f} GB to download"
            return f"{entry.name}: {size}, about {entry.memory_gb_4bit:.1f} GB of memory at 4-bit. {entry.license}."

        model.change(describe, model, model_info)

        def switch(model_id, progress=gr.Progress()):  # noqa: B008 (how gradio injects progress)
            def on_progress(p):
                progress((p.done, p.total), desc=f"Downloading {p.file}", unit="bytes")

            try:
                engine.load(model_id, on_progress)
            except UserError as e:
                gr.Warning(str(e))
            except Exception as e:
                log.exception("switching to %s failed", model_id)
                gr.Warning(f"Loading {model_id} failed ({type(e).__name__}); details are in the log.")
            return engine.status()

        load_btn.click(switch, model, status, **common)

        timer = gr.Timer(1.0)

        def poll_status():
            return engine.status(), gr.Timer(active=engine.loaded is None and not engine.error)

        timer.tick(poll_status, None, [status, timer], api_name="status", queue=False)

        def on_load(s):
            s = _session(s, engine)
            _, problems = _chat_choices()
            for p in startup_problems + problems:
                gr.Warning(p)
            startup_problems.clear()
            return s, engine.status()

        demo.load(on_load, session, [session, status])
    return demo


def _tree_setting(choice: str) -> str:
    return "" if choice == AUTO else choice


def _conversation(turns: list[store.Turn], message: str) -> list[dict]:
    """Earlier turns as messages, then the new user message."""
    pairs = [m for t in turns for m in _pair(t)]
    return [*pairs, {"role": "user", "content": message}]


def _pair(turn: store.Turn) -> list[dict]:
    return [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.assistant}]


def _begin_turn(s: Session, message: str, model_id: str) -> str | None:
    """Add the user's message as a new turn and save the chat before the reply starts, so that a
    kill during the reply loses none of it; the warning to show when the chat cannot be saved."""
    title = s.chat.title
    s.chat.turns.append(store.Turn(user=message))
    if title == "New chat":
        s.chat.title = message.strip().splitlines()[0][:60] or "Chat"
    s.chat.model = model_id
    try:
        store.save_chat(s.chat)
    except OSError as e:  # a full disk, a read-only folder: the message stays in its box
        s.chat.turns.pop()
        s.chat.title = title
        return f"The chat could not be saved ({e.strerror or e}), so the message was not sent."
    return None


def _save_partial(s: Session) -> None:
    if s.chat.turns and s.chat.turns[-1].steps:
        turn = s.chat.turns[-1]
        turn.assistant = "".join(step[0] for step in turn.steps)
        store.save_chat(s.chat)


def css() -> str:
    return (resources.files("assets") / "ui.css").read_text(encoding="utf-8")
