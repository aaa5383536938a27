"""The chat page's event handlers, bound to the one loaded `Engine`: `app.ui` lays out the page
and wires each component's events to a method here. A method's name is the name of its event
in gradio's API (`/send`, `/open_chat`, …), except where `app.ui` names it.

A handler gets the user's `Session` from `gr.State` (None on a fresh page) and returns it
among its outputs; nothing per user is kept here. Warnings go to the page as `gr.Warning`.
The user's message is saved before its reply starts, and the turn again, atomically, as soon
as it ends (or is stopped).
The reply handlers (send, regenerate) return, in order: the chat box, the session, the message
box, the stats, the chat list, the step picker and the title.

Handlers are explained in comments, not docstrings: gradio publishes a handler's docstring as
its API description, and the API stays as it was.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import gradio as gr

from app import store
from app.controls import ACCEPTANCE, Controls
from app.engine import Engine, figures
from app.panels import compare_html, stats_html, step_html
from app.render import reply_html, step_source
from app.ui_session import (
    DRAFT_NONE,
    Session,
    begin_turn,
    chat_choices,
    conversation,
    draft_choices,
    draft_note,
    literal,
    messages,
    on_disk_note,
    reply_stats,
    save_partial,
    tree_setting,
)
from core.decode.generate import Finished
from core.decode.tree import DRAFT_SOURCES
from core.errors import UserError
from models import catalog
from models.draft_model import draft_name

log = logging.getLogger("medusa-chat")


def _downloads(progress: gr.Progress):
    """A loader's on_progress that shows each file's download on `progress`."""

    def on_progress(p) -> None:
        progress((p.done, p.total), desc=f"Downloading {p.file}", unit="bytes")

    return on_progress


def _skips(n: int) -> tuple:
    """n outputs left unchanged, each its own `gr.skip()` (a dict), never one shared object."""
    return tuple(gr.skip() for _ in range(n))


class Handlers:
    """The page's handlers for `engine`; `startup_problems` (damaged chat files found when the
    page was built) are shown on the first page load."""

    def __init__(self, engine: Engine, startup_problems: list[str]) -> None:
        self.engine = engine
        self.startup_problems = startup_problems

    def _session(self, s: Session | None) -> Session:
        return s if s is not None else Session(store.Chat.new(self.engine.model_id))

    # -- a reply ---------------------------------------------------------------------------------

    # Refuse an empty message, bad settings or a message that cannot fit; else save the user's turn and stream
    # its reply.
    def send(self, message: str | None, s: Session | None, *values) -> Iterator[tuple]:
        s, c = self._session(s), Controls.of(values)
        if not message or not message.strip():
            gr.Warning("Type a message first.")
            yield gr.skip(), s, *_skips(5)
            return
        message = store.clean_text(message)  # a lone surrogate sent through the API cannot be saved
        try:  # a bad setting or a message that cannot fit is refused before the turn is stored
            self.engine.reply(c.request(conversation(s.chat.turns, message)))  # runs nothing until its events are read
        except UserError as e:
            gr.Warning(str(e))
            yield gr.skip(), s, *_skips(5)
            return
        if problem := begin_turn(s, message, self.engine.model_id):
            gr.Warning(problem)
            yield gr.skip(), s, *_skips(5)
            return
        yield from self._stream_turn(s, c)

    # The last turn's reply again, with the current settings.
    def regenerate(self, s: Session | None, *values) -> Iterator[tuple]:
        s, c = self._session(s), Controls.of(values)
        if not s.chat.turns:
            gr.Warning("Nothing to regenerate yet.")
            yield gr.skip(), s, *_skips(5)
            return
        last = s.chat.turns[-1]
        s.chat.turns[-1] = store.Turn(user=last.user)
        yield from self._stream_turn(s, c)

    @staticmethod
    def stop(s: Session | None) -> None:
        if s is not None:
            s.stop.set()

    def _stream_turn(self, s: Session, c: Controls) -> Iterator[tuple]:
        """The reply handlers' outputs while the reply streams; what it streamed is kept if it fails."""
        try:
            for chat_value, stats_value, done in self._run_turn(s, c):
                if done:
                    yield (chat_value, s, "", stats_value, *self._finish_outputs(s))
                else:
                    yield chat_value, s, "", stats_value, gr.skip(), gr.skip(), gr.skip()
        except UserError as e:
            gr.Warning(str(e))
            save_partial(s)
            yield messages(s.chat, c.colors), s, *_skips(5)
        except Exception as e:
            log.exception("generation failed")
            gr.Warning(f"Generation failed ({type(e).__name__}: {e}); details are in the log.")
            save_partial(s)
            yield messages(s.chat, c.colors), s, *_skips(5)

    def _run_turn(self, s: Session, c: Controls) -> Iterator[tuple]:
        """Stream the reply to the chat's last turn; save it when it ends.

        Yields (chat box, stats, done): the stats only once done."""
        turn = s.chat.turns[-1]
        s.stop.clear()
        reply = self.engine.reply(c.request(conversation(s.chat.turns[:-1], turn.user)), s.stop.is_set)
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
                s.chat.model = self.engine.model_id
                store.save_chat(s.chat)
                yield messages(s.chat, c.colors), reply_stats(turn.stats, s.events, reply.depth), True
                return
            s.events.append(e)
            for k in e.sources:
                sources[k] += 1
            turn.steps.append((e.text, e.accepted, step_source(e.sources)))
            yield (
                messages(s.chat, c.colors)[:-1]
                + [{"role": "assistant", "content": reply_html(turn.steps, c.colors, streaming=True)}],
                gr.skip(),
                False,
            )

    @staticmethod
    def _finish_outputs(s: Session) -> tuple:
        """Chat list, step picker and title once a reply has ended."""
        choices, _ = chat_choices()
        n = max(len(s.events), 2)
        return gr.update(choices=choices, value=s.chat.id), gr.update(maximum=n, value=1), s.chat.title

    # The last reply's prompt decoded again without speculation, and the speeds side by side.
    def compare(self, s: Session | None, *values) -> str | dict:
        s, c = self._session(s), Controls.of(values)
        if not s.prompt or not s.medusa_stats:
            gr.Warning("Send a message first; the comparison re-runs the last reply without speculation.")
            return gr.skip()
        try:
            *_, done = self.engine.generate(s.prompt, c.settings(), None, lambda: False)
        except UserError as e:
            gr.Warning(str(e))
            return gr.skip()
        return compare_html(s.medusa_stats, done)

    # The step inspector for step `step` (from 1) of the last reply.
    def inspect(self, step: float, s: Session | None) -> str:
        if s is None or not s.events:
            return "<p>No reply yet.</p>"
        e = s.events[min(int(step), len(s.events)) - 1]
        return step_html(e, [self.engine.token_text(t) for t in e.draft])

    # -- the chat list ---------------------------------------------------------------------------

    def new_chat(self, s: Session | None, col: bool) -> tuple:
        s = self._session(s)
        s.chat, s.events = store.Chat.new(self.engine.model_id), []
        return [], s, gr.update(value=None), "", stats_html({}, [], [])

    # Show a saved chat; a damaged file is set aside (named in a warning) and leaves the list.
    def open_chat(self, chat_id: str | None, s: Session | None, col: bool) -> tuple:
        s = self._session(s)
        if not chat_id:
            return gr.skip(), s, gr.skip(), gr.skip(), gr.skip()
        try:  # the file is checked field by field, so what loads also renders
            chat = store.load_chat(chat_id)
        except store.ChatIdError as e:
            gr.Warning(str(e))
            return gr.skip(), s, gr.skip(), gr.skip(), gr.skip()
        except (OSError, ValueError, TypeError, KeyError) as e:
            gr.Warning(store.set_aside(chat_id, e))  # names the file it was moved to
            choices, _ = chat_choices()
            return gr.skip(), s, gr.skip(), gr.skip(), gr.update(choices=choices, value=None)
        s.chat, s.events = chat, []
        last = chat.turns[-1].stats if chat.turns else {}
        return messages(chat, col), s, chat.title, stats_html(last, [], []), gr.skip()

    def rename(self, new_title: str | None, s: Session | None) -> tuple:
        s = self._session(s)
        new_title = store.clean_title(new_title)  # None when the API sends no title
        if not new_title:
            gr.Warning("Type a title first.")
            return gr.skip(), s
        s.chat.title = new_title
        if s.chat.turns:
            store.save_chat(s.chat)
        choices, _ = chat_choices()
        return gr.update(choices=choices, value=s.chat.id if s.chat.turns else None), s

    def delete(self, s: Session | None) -> tuple:
        s = self._session(s)
        try:
            store.delete_chat(s.chat.id)
        except (OSError, UserError) as e:  # a read-only folder; a bad id cannot reach a path
            gr.Warning(f"The chat could not be deleted: {e}")
            return gr.skip(), s, gr.skip(), gr.skip()
        s.chat, s.events = store.Chat.new(self.engine.model_id), []
        choices, _ = chat_choices()
        return [], s, gr.update(choices=choices, value=None), ""

    # The chat as a Markdown file in a folder of its own, for the download button.
    def export(self, s: Session | None) -> str:
        s = self._session(s)
        folder = Path(tempfile.mkdtemp(prefix="medusa-chat-export-"))
        path = folder / store.export_name(s.chat.title)
        path.write_text(s.chat.to_markdown(), encoding="utf-8")
        return str(path)

    # -- settings, the model, the page -----------------------------------------------------------

    @staticmethod
    def recolor(s: Session | None, col: bool) -> list[dict] | dict:
        return messages(s.chat, col) if s is not None else gr.skip()

    # ε and δ apply to Typical acceptance only.
    @staticmethod
    def toggle_typical(acc: str) -> tuple:
        on = acc == ACCEPTANCE[1]
        return gr.update(interactive=on), gr.update(interactive=on)

    # Save the controls as the next start's defaults.
    @staticmethod
    def remember(*values) -> None:
        c = Controls.of(values)
        store.save_settings(asdict(c) | {"tree": tree_setting(c.tree)})

    @staticmethod
    def describe(model_id: str) -> str:
        entry = catalog.find(model_id)
        if entry is None:
            return on_disk_note(model_id) if model_id else ""
        size = "ships with the app" if entry.embedded else f"~{entry.download_gb:.1f} GB to download"
        gated = "; gated: accept its terms on the hub and log in" if entry.gated else ""
        text = (
            f"{entry.name} ({entry.quantization}, for a {entry.target.upper()}): {size}, about "
            f"{entry.memory_gb_4bit:.1f} GB of memory at 4-bit. {entry.license}{gated}. Drafters: {entry.drafter}."
        )
        return literal(text)

    # Download (with progress) and load another model; the status line after.
    def switch(self, model_id: str, progress=gr.Progress()) -> str:  # noqa: B008 (how gradio injects progress)
        try:
            self.engine.load(model_id, _downloads(progress))
        except UserError as e:
            gr.Warning(str(e))
        except Exception as e:
            log.exception("switching to %s failed", model_id)
            gr.Warning(f"Loading {model_id} failed ({type(e).__name__}); details are in the log.")
        return self.engine.status()

    # Load the draft model chosen (an id, a folder, "self" or "none"), with progress; a refusal is warned
    # and the control goes back to the draft model loaded. Returns the control, the line under it and the status.
    def set_draft_model(self, choice: str | None, progress=gr.Progress()) -> tuple:  # noqa: B008
        name = draft_name(choice)
        if name != self.engine.draft_model:
            try:
                self.engine.set_draft_model(name, _downloads(progress))
            except UserError as e:
                gr.Warning(str(e))
                return *self._draft_outputs(str(e)), self.engine.status()
            except Exception as e:
                log.exception("loading the draft model %s failed", name)
                problem = f"Loading the draft model {name} failed ({type(e).__name__}); details are in the log."
                gr.Warning(problem)
                return *self._draft_outputs(problem), self.engine.status()
        return *self._draft_outputs(), self.engine.status()

    # The draft-model control and the line under it, for the model and the draft model loaded now.
    def draft_state(self) -> tuple:
        return self._draft_outputs()

    def _draft_outputs(self, problem: str = "") -> tuple:
        """The draft-model control (back on the draft model loaded) and the line under it: `problem`
        where there is one, else the loaded draft model or the catalog's suggestion."""
        loaded = self.engine.draft_model
        suggested = catalog.draft_for(self.engine.model_id)
        own = self.engine.loaded
        own_drafter = None if own is None else bool(own.trained or own.eagle is not None)
        note = literal(problem) if problem else draft_note(loaded, suggested, own_drafter)
        choices = draft_choices(suggested, loaded)
        return gr.update(choices=choices, value=loaded or DRAFT_NONE), note

    # The status line, polled until the model has loaded (or failed to).
    def poll_status(self) -> tuple:
        return self.engine.status(), gr.Timer(active=self.engine.loaded is None and not self.engine.error)

    # A page load: its session, the status line, and warnings for damaged chat files.
    def on_load(self, s: Session | None) -> tuple:
        s = self._session(s)
        _, problems = chat_choices()
        for p in self.startup_problems + problems:
            gr.Warning(p)
        self.startup_problems.clear()
        return s, self.engine.status()
