"""The loaded model the UI talks to, shared by every browser tab.

It loads in the background so the page is ready at once, can switch to another catalog
model (downloading with progress), and turns a conversation plus settings into the core's
event stream. All model work (loading, decoding, measuring this machine's step costs) runs on
one `ComputeThread`, in order, one job at a time. No decoding logic here.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from core import fast
from core.drafters import make_drafter
from core.errors import UserError
from core.generate import Finished, StepEvent, context_length, stream
from core.history import Fitted, fit_history
from core.settings import DecodeSettings
from core.step import Drafter
from core.tree import AUTO, Preset, load_preset, preset_names
from core.tune.costs import StepCosts
from core.tune.policy import auto_drafter
from core.worker import ComputeThread
from models.loader import Backbone, heads_for, load_backbone, resolve, resolve_heads, step_costs

log = logging.getLogger("medusa-chat")


@dataclass(frozen=True)
class Loaded:
    backbone: Backbone
    heads: torch.nn.Module
    trained: bool  # False: untrained heads, few drafts accepted
    default_tree: str  # the model's calibrated preset (what the policy's priors come from)
    costs: StepCosts  # this machine's step-cost curve for the model, measured once


class Engine:
    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", quantization: str = "auto",
                 heads: str | None = None) -> None:  # fmt: skip
        self.options = {"dtype": dtype, "device": device, "quantization": quantization}
        self.heads_arg = heads
        self.model_id = model
        self.loaded: Loaded | None = None
        self.error: str | None = None
        self._drafters: dict[tuple[str, str], tuple[Preset, Drafter]] = {}
        self.compute = ComputeThread()

    def start(self) -> None:
        """Load the initial model in the background."""
        self.compute.submit(self._load_initial)

    def _load_initial(self) -> None:
        try:
            self.load(self.model_id)
        except UserError as e:
            self.error = str(e)
        except Exception as e:
            log.exception("loading %s failed", self.model_id)
            self.error = f"Loading {self.model_id} failed ({type(e).__name__}: {e}); see the log."

    def load(self, model: str, on_progress: Callable | None = None) -> None:
        spec = resolve(model, on_progress)  # downloads here, in the caller's thread

        def build() -> Loaded:
            backbone = load_backbone(model, spec=spec, **self.options)
            own = self.heads_arg and model == self.model_id
            heads_dir = resolve_heads(self.heads_arg) if own else spec.heads_folder
            heads, trained = heads_for(backbone, heads_dir)
            default = spec.tree if spec.tree in preset_names() else "cpu-16"
            return Loaded(backbone, heads, trained, default, step_costs(backbone, heads))

        loaded = self.compute.call(build)
        self.loaded, self.model_id, self.error = loaded, model, None
        self._drafters.clear()
        if loaded.costs.needed:  # one tree size per job, so a reply waits for one size at most
            self._measure(loaded.costs.steps())

    def _measure(self, steps: Iterator[None]) -> None:
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
        dtype = str(b.model.dtype).removeprefix("torch.")
        # a many-token verify forward rounds differently from a one-token one below float32
        exact = "" if b.model.dtype == torch.float32 else f" · lossless is exact up to {dtype} rounding"
        precision = f"int4 weights, {dtype}" if fast.layer_kernel(b.model) == "int4" else dtype
        return f"**Ready:** {self.model_id} · {precision} on {b.model.device.type} · {heads}{exact}"

    def require(self) -> Loaded:
        if self.loaded is None:
            raise UserError(self.error or f"{self.model_id} is still loading; try again in a moment.")
        return self.loaded

    def drafter(self, tree_name: str, kind: str | None = None) -> tuple[Preset, Drafter]:
        """The tree preset and a drafter of `kind` (default: the one the preset was calibrated for).
        `tree_name` AUTO: the speculation policy, with the model's own preset as its prior."""
        key = (tree_name, kind or "")
        if key not in self._drafters:
            loaded = self.require()
            if tree_name == AUTO:
                preset = load_preset(loaded.default_tree)
                drafter = auto_drafter(kind or preset.drafter, loaded.heads, loaded.costs.curve, preset, loaded.trained)
            else:
                preset = load_preset(tree_name)
                tree = preset.tree.to(loaded.backbone.model.device)
                drafter = make_drafter(
                    kind or preset.drafter, loaded.heads, tree, f"Tree '{preset.name}'",
                    preset.lookup_branches, preset.lookup_length,
                )  # fmt: skip
            self._drafters[key] = (preset, drafter)
        return self._drafters[key]

    def prepare(self, messages: list[dict], system: str, settings: DecodeSettings) -> Fitted:
        """The prompt for a conversation, its oldest turns left out if it would not fit the
        context with room for the reply; a UserError if the newest message cannot fit at all."""
        b = self.require().backbone
        return fit_history(
            b.encode_messages, messages, system or None, context_length(b.model), settings.max_new_tokens
        )

    def generate(
        self,
        prompt_ids: list[int],
        settings: DecodeSettings,
        drafter_kind: str | None,
        tree_name: str,
        should_stop: Callable[[], bool],
    ) -> Iterator[StepEvent | Finished]:
        """`drafter_kind`: "medusa", "lookup", "hybrid", "" for the tree's own, None for plain decoding."""
        loaded = self.require()
        b = loaded.backbone
        drafter = None if drafter_kind is None else self.drafter(tree_name, drafter_kind or None)[1]
        # a fresh seed per reply from the OS, without touching torch's global generator
        generator = torch.Generator(b.model.device).manual_seed(secrets.randbits(63))

        def stopping() -> bool:  # closing the app ends a reply as Stop does, so what was written is kept
            return should_stop() or self.compute.closing

        return self.compute.stream(
            lambda: stream(b.model, prompt_ids, settings, drafter, b.tokenizer, b.eos_ids, generator, stopping)
        )

    def token_text(self, token_id: int) -> str:
        return self.require().backbone.tokenizer.decode([token_id])
