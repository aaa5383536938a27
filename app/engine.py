"""The loaded model the UI talks to, shared by every browser tab.

It loads in the background so the page is ready at once, can switch to another catalog
model (downloading with progress), and turns a conversation plus settings into the core's
event stream. All model work (loading, decoding, measuring this machine's step costs) runs on
one `ComputeThread`, in order, one job at a time: a whole reply is one job, so replies asked
for by the chat and by the API never run at once. `Engine.reply` is the one way in for both:
a `ReplyRequest` (a conversation and its settings) becomes a `Reply` (the fitted prompt, the
resolved tree and drafter, and the event stream). No decoding logic here.

The last reply's cache is kept (`core.backends.cache.Kept`): the next request, whatever asks for it,
reads only the part of its prompt that the kept conversation does not share. One conversation
is kept at a time, for the loaded model only (loading another drops it).

A draft model (`--draft-model`, `set_draft_model`) loads with the model and can be swapped while
the app runs; it belongs to the model it drafts for, so switching models drops it, except `self`
(the model's own weights in 4 bits), which is loaded again for the new model. The draft drafter
keeps its own cache, so swapping it leaves the kept conversation as it is.
"""

from __future__ import annotations

import logging
import secrets
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from app.drafting import EVERYTHING, load_parts
from app.history import Fitted, fit_history
from app.worker import ComputeThread
from core.backends.cache import Kept
from core.decode.generate import Finished, StepEvent, context_length, stream
from core.decode.precision import EXACT, compute_dtype, exactness, quantization
from core.decode.settings import MODES, DecodeSettings
from core.decode.tree import AUTO, Preset, load_preset, preset_names
from core.drafters import registry
from core.drafters.base import Drafter
from core.drafters.build import auto_drafter, make_drafter
from core.drafters.draft_model import DraftModel
from core.drafters.eagle import EagleDraft
from core.drafters.retrieval import Corpus
from core.errors import UserError
from core.measure.costs import StepCosts
from models.draft_model import FOUR_BIT, SELF, draft_name, load_draft_model
from models.loader import Backbone, load_backbone, resolve, resolve_eagle, resolve_heads, step_costs

LEARN_BATCH = 100  # saved replies tokenized per compute job
log = logging.getLogger("medusa-chat")

MODEL_TREE = "(model default)"  # the tree name that means the loaded model's calibrated preset
DRAFT_OFF = "The chat runs without a draft model."  # after a draft model's failure at launch or a model switch


class NotReady(UserError):
    """No model to answer with: it is still loading, or loading it failed."""


@dataclass(frozen=True)
class ReplyRequest:
    messages: list[dict]  # the conversation ({"role", "content"}), oldest first, ending with the user's message
    settings: DecodeSettings
    system: str = ""  # the system prompt ("" for none)
    mode: str = "medusa"  # one of MODES: tree decoding, or the plain one-token loop
    tree: str = AUTO  # AUTO (the policy chooses each step's tree), MODEL_TREE or a preset name
    drafter: str = ""  # one of registry.DRAFTERS, or "" for the one the tree was calibrated with
    seed: int | None = None  # for sampling; None: a fresh seed from the OS


@dataclass(frozen=True)
class Reply:
    prompt_ids: list[int]  # the prompt the model reads (oldest turns left out if they did not fit)
    note: str  # a sentence saying which oldest messages were left out, or ""
    dropped: int  # how many messages were left out
    tree: str | None  # the tree resolved (AUTO or a preset name); None for plain decoding
    drafter: str | None  # the drafter resolved; None for plain decoding
    depth: int  # how far ahead the drafts reach (0 for plain decoding): the depths stats are kept for
    events: Iterator[StepEvent | Finished] = field(repr=False)  # the stream; starts when first read
    draft_model: str | None = None  # the draft model loaded when the reply was asked for (None: none)


@dataclass(frozen=True)
class Loaded:
    backbone: Backbone
    heads: torch.nn.Module
    trained: bool  # False: untrained heads, few drafts accepted
    default_tree: str  # the model's calibrated preset (what the policy's priors come from)
    costs: StepCosts  # this machine's step-cost curve for the model, measured once
    corpus: Corpus | None = None  # the model's past replies, for retrieval drafting (None: none ships)
    eagle: EagleDraft | None = None  # the EAGLE draft layer (None: none ships or was given)
    draft: DraftModel | None = None  # the draft model (None: none given, or it failed to load)


class Engine:
    """`past_replies`: the assistant texts of the user's saved chats, which retrieval drafting
    also copies from (with every reply finished here); None: neither (the user opted out)."""

    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", quantization: str = "auto",
                 heads: str | None = None, past_replies: Callable[[], list[str]] | None = None,
                 eagle: str | None = None, draft_model: str | None = None) -> None:  # fmt: skip
        self.options = {"dtype": dtype, "device": device, "quantization": quantization}
        self.eagle_arg = eagle
        self.draft_arg = draft_name(draft_model)  # loaded with the model the app starts with
        self.past_replies = past_replies
        self.heads_arg = heads
        self.model_id = model
        self.loaded: Loaded | None = None
        self.error: str | None = None
        self._drafters: dict[tuple[str, str], tuple[Preset, Drafter]] = {}
        self._drafters_lock = threading.Lock()  # the chat and the API ask from threads of their own
        self.kept = Kept()  # the last reply's cache (one conversation), used and replaced on the compute thread
        self.compute = ComputeThread()

    def start(self) -> Future[None]:
        """Load the initial model in the background; the future is done once it has loaded (or
        failed, saying why in `error`)."""
        return self.compute.submit(self._load_initial)

    def _load_initial(self) -> None:
        try:
            self.load(self.model_id)
        except UserError as e:
            self.error = str(e)
        except Exception as e:
            log.exception("loading %s failed", self.model_id)
            self.error = f"Loading {self.model_id} failed ({type(e).__name__}: {e}); see the log."

    def load(self, model: str, on_progress: Callable | None = None, draft_model: str | None = None) -> None:
        """Load `model` (with `draft_model`, else the draft model `_draft_after` keeps)."""
        spec = resolve(model, on_progress)  # downloads here, in the caller's thread
        own = model == self.model_id  # --heads and --eagle belong to the model the app started with
        heads_dir = resolve_heads(self.heads_arg, on_progress) if own and self.heads_arg else spec.heads_folder
        eagle_path = spec.eagle
        if own and self.eagle_arg:
            try:
                eagle_path = resolve_eagle(self.eagle_arg, on_progress)
            except UserError as e:  # a bad --eagle costs the EAGLE drafter, not the model
                print(f"{e} The EAGLE drafter is off.", file=sys.stderr)
                eagle_path = None
        draft = draft_model or self._draft_after(
            model, own
        )  # a draft model downloads in `build`, on the compute thread

        def build() -> Loaded:
            self.kept.clear()  # the old model's cache: no use to another, and its memory is wanted now
            backbone = load_backbone(model, spec=spec, **self.options)
            parts = load_parts(backbone, EVERYTHING, heads_dir, eagle_path)  # a layer that does not fit: EAGLE is off
            default = spec.tree if spec.tree in preset_names() else "cpu-16"
            costs = step_costs(backbone, parts.heads)
            loaded = Loaded(backbone, parts.heads, parts.trained, default, costs, parts.corpus, parts.eagle,
                            self._draft_or_none(backbone, draft))  # fmt: skip
            self._install(loaded)  # here, on the compute thread: no reply or draft model swap runs in between
            self.model_id, self.error = model, None
            return loaded

        loaded = self.compute.call(build)
        if loaded.corpus is not None and self.past_replies is not None:  # at idle moments, like the costs
            self._measure(self._learn(loaded))
        if loaded.costs.needed:  # one tree size per job, so a reply waits for one size at most
            self._measure(loaded.costs.steps())

    def _install(self, loaded: Loaded) -> None:
        """Make `loaded` the engine's (on the compute thread), dropping the drafters built from the one it replaces."""
        with self._drafters_lock:
            self.loaded = loaded
            self._drafters.clear()

    @property
    def draft_model(self) -> str | None:
        """The loaded draft model's name, as it was given (a catalog id, a hub repo, a folder or self); None: none."""
        draft = getattr(self.loaded, "draft", None)  # (None while loading)
        return draft.name if draft is not None else None

    def set_draft_model(self, name: str | None, on_progress: Callable | None = None) -> None:
        """Draft with the model `name` (a catalog id, a hub repo, a folder, or self: the loaded
        model's own weights in 4 bits) from the next reply on; None, "" or "none": no draft model.
        It downloads in the caller's thread and loads on the compute thread, after the replies
        queued. One sentence (UserError) if it does not load or does not fit the loaded model
        (another vocabulary, self on a model in 4 bits), or no model is loaded: the draft model
        loaded before stays. `self` where the model runs in 4 bits by default loads the model
        again in full precision first."""
        name = draft_name(name)
        loaded = self.require()
        if name == self.draft_model:
            return
        if name == SELF and self.options["quantization"] == "auto" and loaded.backbone.backend.layer_kernel in FOUR_BIT:
            self._reload_for_self(on_progress)
            return
        if name is not None and name != SELF:
            resolve(name, on_progress)  # downloads here; an unknown name is refused before anything is queued

        def swap() -> None:
            loaded = self.require()  # the model loaded now, whatever loaded while this waited
            self._install(replace(loaded, draft=self._load_draft(loaded.backbone, name) if name else None))

        self.compute.call(swap)

    def _reload_for_self(self, on_progress: Callable | None) -> None:
        """`self` asked for where the model runs in 4 bits by default: the model is loaded again in
        full precision, its own 4-bit copy drafting for it (the full model's replies, faster)."""
        before = self.options
        self.options = {**before, "quantization": "none"}
        try:
            self.load(self.model_id, on_progress, draft_model=SELF)
        except BaseException:
            self.options = before  # the model loaded before stays, and so does how it loads
            raise
        if self.draft_model != SELF:
            raise UserError(
                f"{self.model_id} now runs in full precision, but its 4-bit copy did not load to draft for it."
            )

    def _draft_after(self, model: str, own: bool) -> str | None:
        """The draft model to load with `model`: the one loaded now (before the first load, --draft-model) when
        `own` (the same model again); for another model only self, which is that model's own weights."""
        current = self.draft_model if self.loaded is not None else self.draft_arg
        return current if own or current == SELF else None

    def _draft_or_none(self, backbone: Backbone, name: str | None) -> DraftModel | None:
        """The draft model `name` for `backbone`; None, saying why on stderr, if it does not load or fit."""
        if name is None:
            return None
        try:
            return self._load_draft(backbone, name)
        except UserError as e:  # a bad draft model costs the draft model, not the model
            print(f"{e} {DRAFT_OFF}", file=sys.stderr)
            return None

    def _load_draft(self, backbone: Backbone, name: str) -> DraftModel:
        """`models.draft_model.load_draft_model`, with any failure as one sentence (UserError)."""
        try:
            return load_draft_model(backbone, name)
        except UserError:
            raise
        except Exception as e:
            log.exception("loading the draft model %s failed", name)
            raise UserError(f"Loading the draft model {name} failed ({type(e).__name__}); see the log.") from e

    def _learn(self, loaded: Loaded) -> Iterator[None]:
        """Index the user's saved replies for retrieval drafting: tokenized `LEARN_BATCH` at a time,
        one job each (a reply waits for one batch at most), then indexed once."""
        texts = [t for t in self.past_replies() if t.strip()]
        encode, docs = loaded.backbone.tokenizer.encode, []
        for start in range(0, len(texts), LEARN_BATCH):
            docs += [encode(t, add_special_tokens=False) for t in texts[start : start + LEARN_BATCH]]
            yield
        loaded.corpus.add(docs)

    def _measure(self, steps: Iterator[None]) -> None:
        """Run `steps` one at a time on the compute thread, each as its own job."""

        def one() -> None:
            if next(steps, StopIteration) is not StopIteration:
                self.compute.submit(one)

        self.compute.submit(one)

    def status(self) -> str:
        if self.error:
            return f"**Problem:** {self.error}"
        if self.loaded is None:
            return f"**Loading** {self.model_id}…"
        b = self.loaded.backbone
        heads = "trained heads" if self.loaded.trained else "untrained heads (few drafts accepted)"
        heads += " · EAGLE drafter" if self.loaded.eagle is not None else ""
        heads += f" · draft model {self.draft_model}" if self.draft_model else ""
        dtype = str(b.model.dtype).removeprefix("torch.")
        # a tree's many-row verify forward may round unlike a one-row step (bf16, 4-bit kernels, GPUs)
        promise = exactness(b.backend)
        exact = "" if promise == EXACT else f" · lossless is {promise}"
        precision = f"4-bit weights, {dtype}" if b.backend.layer_kernel in ("int4", "q4") else dtype
        if quant := quantization(b.model):  # bitsandbytes' layers compute in its own dtype, whatever --dtype said
            precision = f"{quant} weights, {str(compute_dtype(b.model)).removeprefix('torch.')}"
        return f"**Ready:** {self.model_id} · {precision} on {b.model.device.type} · {heads}{exact}"

    def require(self) -> Loaded:
        if self.loaded is None:
            raise NotReady(self.error or f"{self.model_id} is still loading; try again in a moment.")
        return self.loaded

    def drafter(self, tree_name: str, kind: str | None = None) -> tuple[Preset, Drafter]:
        """The tree preset and a drafter of `kind` (default: the one the preset was calibrated for).
        `tree_name` AUTO: the speculation policy, with the model's own preset as its prior."""
        key = (tree_name, kind or "")
        with self._drafters_lock:
            if key not in self._drafters:
                self._drafters[key] = self._new_drafter(tree_name, kind)
            return self._drafters[key]

    def _new_drafter(self, tree_name: str, kind: str | None) -> tuple[Preset, Drafter]:
        loaded = self.require()
        if tree_name == AUTO:
            preset = load_preset(loaded.default_tree)
            kind, costs = kind or self._default_kind(preset), loaded.costs
            parts = (loaded.heads, costs.curve, preset, loaded.trained, loaded.corpus, loaded.eagle, loaded.draft)
            drafter = auto_drafter(kind, *parts, costs.rates(kind))
        else:
            preset = load_preset(tree_name)
            tree = preset.tree.to(loaded.backbone.model.device)
            drafter = make_drafter(
                kind or self._default_kind(preset), loaded.heads, tree, f"Tree '{preset.name}'",
                preset.lookup_branches, preset.lookup_length, loaded.corpus, loaded.eagle, loaded.draft,
            )  # fmt: skip
        return preset, drafter

    def _default_kind(self, preset: Preset) -> str:
        """The drafter that runs where the request names none (the preset's, or the draft model's)."""
        return registry.default_kind(preset.drafter, self.draft_model is not None)

    def prepare(self, messages: list[dict], system: str, settings: DecodeSettings) -> Fitted:
        """The prompt for a conversation, its oldest turns left out if it would not fit the
        context with room for the reply; a ContextExceeded if the newest message cannot fit at all."""
        b = self.require().backbone
        return fit_history(
            b.encode_messages, messages, system or None, context_length(b.model), settings.max_new_tokens
        )

    def reply(self, request: ReplyRequest, should_stop: Callable[[], bool] = lambda: False) -> Reply:
        """Fit the conversation, resolve its tree and drafter, and queue the reply (behind any
        reply in progress). Mistakes (a bad mode, tree or drafter, a message that cannot fit,
        no model yet) raise a UserError here, before anything is queued."""
        if request.mode not in MODES:
            raise UserError(f"The mode must be {' or '.join(MODES)}, got '{request.mode}'.")
        if request.drafter:
            registry.kind(request.drafter)  # an unknown one is refused here
        fitted = self.prepare(request.messages, request.system, request.settings)
        tree, kind, depth, drafter, draft = None, None, 0, None, self.draft_model
        if request.mode == "medusa":
            tree = self._tree(request.tree)
            preset, drafter = self.drafter(tree, request.drafter or None)
            kind = request.drafter or self._default_kind(preset)
            heads = self.require().heads.num_heads if tree == AUTO else preset.tree.max_depth
            depth = registry.kind(kind).reach(heads, preset.lookup_length)
        events = self.generate(fitted.ids, request.settings, drafter, should_stop, request.seed)
        return Reply(fitted.ids, fitted.note, fitted.dropped, tree, kind, depth, events, draft)

    def _tree(self, choice: str) -> str:
        """A tree choice as AUTO or a preset name ("" means AUTO, MODEL_TREE the model's own preset)."""
        if choice in ("", AUTO):
            return AUTO
        if choice == MODEL_TREE:
            return self.require().default_tree
        if choice not in preset_names():
            raise UserError(
                f"Unknown tree '{choice}'; choose {AUTO}, {MODEL_TREE} or one of {', '.join(preset_names())}."
            )
        return choice

    def generate(
        self,
        prompt_ids: list[int],
        settings: DecodeSettings,
        drafter: Drafter | None,
        should_stop: Callable[[], bool],
        seed: int | None = None,
    ) -> Iterator[StepEvent | Finished]:
        """The event stream of one reply to `prompt_ids`, run on the compute thread; `drafter` None
        is plain decoding. `seed` None: a fresh seed from the OS, without touching torch's global generator."""
        loaded = self.require()
        b = loaded.backbone
        generator = torch.Generator(b.model.device).manual_seed(secrets.randbits(63) if seed is None else seed)
        corpus = loaded.corpus if self.past_replies is not None else None

        def stopped() -> bool:
            return self.compute.closing or should_stop()  # closing ends a reply at its next step

        def run() -> Iterator[StepEvent | Finished]:
            events = stream(
                b.backend, prompt_ids, settings, drafter, b.tokenizer, b.eos_ids, generator, stopped, self.kept
            )
            for event in events:
                if isinstance(event, Finished) and corpus is not None and event.finish_reason != "cancelled":
                    corpus.add([list(event.token_ids)])  # later replies may draft from this one
                yield event

        return self.compute.stream(run)

    def close(self, timeout: float | None = None) -> bool:
        """End the work in progress (a reply at its next step; loading runs to its end) and drop
        what is queued, so the process can exit cleanly; waits up to `timeout` seconds (None: as
        long as it takes). True once the compute thread has ended."""
        return self.compute.close(timeout)

    def token_text(self, token_id: int) -> str:
        return self.require().backbone.tokenizer.decode([token_id])


def figures(done: Finished) -> dict:
    """A finished reply's numbers, as the chat's stats and the API's `medusa` field give them."""
    return {
        "tokens": len(done.token_ids), "steps": done.steps, "seconds": done.seconds,
        "tokens_per_step": done.tokens_per_step, "tokens_per_second": done.tokens_per_second,
        "first_token_seconds": done.first_token_seconds, "finish_reason": done.finish_reason,
        "exactness": done.exactness, "prompt_read": done.prompt_read, "prompt_reused": done.prompt_reused,
    }  # fmt: skip
