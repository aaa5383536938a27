"""The Gradio chat page: its layout, and each component's events wired to a handler.

The handlers are `app.ui_events.Handlers`, bound to the loaded `Engine` passed to `build`;
everything per user lives in a `Session` (`app.ui_session`) held by `gr.State`. This module
holds no decoding logic and no state of its own.
"""

from __future__ import annotations

from importlib import resources
from types import SimpleNamespace

import gradio as gr

from app import store
from app.controls import ACCEPTANCE, DECODING, DEFAULTS, DRAFTER_MENU, NAMES
from app.engine import MODEL_TREE, Engine
from app.panels import stats_html
from app.render import LEGEND
from app.ui_events import Handlers
from app.ui_session import DRAFT_NONE, chat_choices, draft_choices, draft_note, on_disk_choices
from core.decode.tree import AUTO, preset_names
from models import catalog


def build(engine: Engine) -> gr.Blocks:
    """The chat page for `engine`: the layout, then every event wired to its handler."""
    saved = DEFAULTS | store.load_settings()
    trees = preset_names()
    chats, startup_problems = chat_choices()  # damaged files found now are reported on the first page load

    with gr.Blocks(title="medusa-chat") as demo:
        session = gr.State(None)
        sidebar = _sidebar(chats)
        with gr.Row():
            chat = _chat_column(engine)
            with gr.Column(scale=2):
                named, draft = _decoding(saved, trees, engine)
                panels = _panels(engine)
        timer = gr.Timer(1.0)
        page = SimpleNamespace(
            **vars(sidebar), **vars(chat), **vars(panels), **vars(draft), **named, session=session, timer=timer
        )
        _wire(demo, page, [named[name] for name in NAMES], Handlers(engine, startup_problems))
    return demo


def css() -> str:
    return (resources.files("assets") / "ui.css").read_text(encoding="utf-8")


# -- layout ---------------------------------------------------------------------------------------


def _sidebar(chats: list[tuple[str, str]]) -> SimpleNamespace:
    """The chat list and what acts on the open chat."""
    with gr.Sidebar(open=True):
        gr.Markdown("### Chats")
        new_btn = gr.Button("New chat", variant="secondary")
        chat_list = gr.Radio(choices=chats, label="Past chats", elem_id="chat-list")
        title = gr.Textbox(label="Title", placeholder="Rename this chat")
        with gr.Row():
            rename_btn = gr.Button("Rename", size="sm")
            delete_btn = gr.Button("Delete", size="sm", variant="stop")
        export_btn = gr.DownloadButton("Export as Markdown", size="sm")
    return SimpleNamespace(
        new_btn=new_btn, chat_list=chat_list, title=title, rename_btn=rename_btn, delete_btn=delete_btn,
        export_btn=export_btn,
    )  # fmt: skip


def _chat_column(engine: Engine) -> SimpleNamespace:
    """The status line, the chat, the message box and the reply's buttons."""
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
    return SimpleNamespace(
        status=status, chatbot=chatbot, msg=msg, send_btn=send_btn, stop_btn=stop_btn, regen_btn=regen_btn,
        compare_btn=compare_btn, compare_out=compare_out,
    )  # fmt: skip


def _decoding(saved: dict, trees: list, engine: Engine) -> tuple[dict[str, gr.components.Component], SimpleNamespace]:
    """The decoding controls, starting from the saved settings, by the names of `app.controls.NAMES`;
    then the draft-model control (the engine's, not a reply's setting)."""
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
        temperature = gr.Slider(0.0, 2.0, value=saved["temperature"], step=0.05, label="Temperature (0 = greedy)")
        top_p = gr.Slider(0.05, 1.0, value=saved["top_p"], step=0.05, label="Top-p")
        max_new = gr.Slider(16, 2048, value=saved["max_new_tokens"], step=16, label="Max new tokens")
        tree = gr.Dropdown(
            [("Auto: chosen each step for this machine", AUTO),
             ("The model's calibrated tree", MODEL_TREE), *trees],
            value=saved["tree"] or AUTO, label="Tree", elem_id="tree",
            info="Auto prices every tree (plain decoding included) with this machine's measured costs",
        )  # fmt: skip
        drafter = gr.Dropdown(
            DRAFTER_MENU,
            value=saved["drafter"], label="Drafter", elem_id="drafter",
            info="Where drafts come from: the heads, copies from the conversation or from the model's "
            "past replies, all in one tree, the EAGLE draft layer, or the draft model below",
        )  # fmt: skip
        draft = _draft_model(engine)
        colors = gr.Checkbox(value=saved["colors"], label="Color the tokens of each step", elem_id="colors")
        system = gr.Textbox(value=saved["system"], label="System prompt", lines=2)
    return {
        "system": system, "decoding": decoding, "acceptance": acceptance, "epsilon": epsilon, "delta": delta,
        "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new, "tree": tree, "drafter": drafter,
        "colors": colors,
    }, draft  # fmt: skip


def _draft_model(engine: Engine) -> SimpleNamespace:
    """The draft model the engine holds: none, the model itself in 4 bits, the catalog's suggestion
    or any id or folder typed in; the line under it says what is loaded or suggests one."""
    loaded, suggested = engine.draft_model, catalog.draft_for(engine.model_id)
    draft_model = gr.Dropdown(
        draft_choices(suggested, loaded), value=loaded or DRAFT_NONE, allow_custom_value=True,
        label="Draft model", elem_id="draft-model",
        info="A smaller model with this model's tokenizer that drafts for it; type a hub id or a folder",
    )  # fmt: skip
    draft_info = gr.Markdown(draft_note(loaded, suggested, None), elem_id="draft-info")
    return SimpleNamespace(draft_model=draft_model, draft_info=draft_info)


def _panels(engine: Engine) -> SimpleNamespace:
    """The model picker, the last reply's stats and the step inspector."""
    with gr.Accordion("Model", open=False):
        model = gr.Dropdown(_model_choices(), value=engine.model_id, label="Model", elem_id="model")
        model_info = gr.Markdown()
        load_btn = gr.Button("Download and load")
    with gr.Accordion("Reply stats", open=True):
        stats = gr.HTML(stats_html({}, [], []), elem_id="stats")
    with gr.Accordion("Step inspector", open=False):
        step_pick = gr.Slider(1, 2, value=1, step=1, label="Step of the last reply")
        inspector = gr.HTML()
    return SimpleNamespace(
        model=model, model_info=model_info, load_btn=load_btn, stats=stats, step_pick=step_pick, inspector=inspector
    )


def _model_choices() -> list[tuple[str, str]]:
    """The catalog's models, each with whether it is cached and its memory at 4-bit, then the models
    already on this machine."""
    from models.hub import cached_state

    out = []
    for e in catalog.entries():
        if e.embedded:
            state = "embedded"
        else:
            cached = cached_state(e.sources)
            state = "cached" if cached == "cached" else f"{e.download_gb:.1f} GB download"
        gated = " · gated" if e.gated else ""
        out.append((f"{e.name} · {e.target.upper()} · {state} · ~{e.memory_gb_4bit:.1f} GB at 4-bit{gated}", e.id))
    return out + on_disk_choices()  # then what Ollama, LM Studio and the hub cache hold


# -- events ---------------------------------------------------------------------------------------


def _wire(demo: gr.Blocks, p: SimpleNamespace, controls: list, h: Handlers) -> None:
    """Every event to its handler. `controls` are a handler's `*values` (Controls.of names them
    again). The order of the events is their order in gradio's API: kept as it was."""
    # a reply: one at a time across the app (one model), so these share one concurrency group
    gen_outputs = [p.chatbot, p.session, p.msg, p.stats, p.chat_list, p.step_pick, p.title]
    common = {"concurrency_id": "generate", "concurrency_limit": 1}
    p.send_btn.click(h.send, [p.msg, p.session, *controls], gen_outputs, api_name="send", **common)
    p.msg.submit(h.send, [p.msg, p.session, *controls], gen_outputs, api_name=False, **common)
    p.regen_btn.click(h.regenerate, [p.session, *controls], gen_outputs, api_name="regenerate", **common)
    p.stop_btn.click(h.stop, [p.session], None, api_name="stop", queue=False)

    # the chat list
    p.new_btn.click(h.new_chat, [p.session, p.colors], [p.chatbot, p.session, p.chat_list, p.title, p.stats],
                    api_name="new_chat")  # fmt: skip
    p.chat_list.input(
        h.open_chat, [p.chat_list, p.session, p.colors], [p.chatbot, p.session, p.title, p.stats, p.chat_list]
    )
    p.rename_btn.click(h.rename, [p.title, p.session], [p.chat_list, p.session])
    p.delete_btn.click(h.delete, [p.session], [p.chatbot, p.session, p.chat_list, p.title])
    p.export_btn.click(h.export, [p.session], p.export_btn)

    # the controls
    p.colors.change(h.recolor, [p.session, p.colors], p.chatbot)
    p.acceptance.change(h.toggle_typical, p.acceptance, [p.epsilon, p.delta])
    for c in controls:  # any change saves them all as the next start's defaults: one at a time, in
        # the order the changes were made (unqueued, a slow earlier save could land after a later one)
        c.change(h.remember, controls, None, concurrency_id="remember", concurrency_limit=1)

    # the last reply, the model, the page
    p.compare_btn.click(h.compare, [p.session, *controls], p.compare_out, api_name="compare", **common)
    p.step_pick.change(h.inspect, [p.step_pick, p.session], p.inspector)
    p.model.change(h.describe, p.model, p.model_info)
    p.load_btn.click(h.switch, p.model, p.status, **common)
    p.timer.tick(h.poll_status, None, [p.status, p.timer], api_name="status", queue=False)
    demo.load(h.on_load, p.session, [p.session, p.status])

    # the draft model: loaded on the model thread like a model switch, one at a time with replies;
    # `input` (the user's change only): putting the control back after a refusal loads nothing
    draft_outputs = [p.draft_model, p.draft_info]
    p.draft_model.input(h.set_draft_model, p.draft_model, [*draft_outputs, p.status], **common)
    # the model or the draft model changed (a switch, the first load): its choices and suggestion again
    p.status.change(h.draft_state, None, draft_outputs, api_name=False, queue=False)
