"""The chat's decoding controls by name: what the settings file keeps and what a reply is asked with.

The UI passes its controls to a handler in the order of `NAMES`; `Controls.of` names them, so
no handler counts positions. A control shows a label ("Medusa", "Lossless"); `request` turns
the labels into the engine's names. No Gradio here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from app.engine import ReplyRequest
from core.decode.settings import ACCEPTANCE_RULES, MODES, DecodeSettings
from core.drafters.registry import KINDS

_DEFAULT = DecodeSettings()
DECODING = {"Medusa": MODES[0], "Plain": MODES[1]}  # label → engine mode
ACCEPTANCE = [rule.capitalize() for rule in ACCEPTANCE_RULES]  # the labels: "Lossless", "Typical"
MENU_FIRST = "hybrid"  # the drafter listed first after the tree's own: every source in one tree
# the drafter menu's (label, kind): the tree's own, then every kind of the registry
DRAFTER_MENU = [
    ("The tree's own", ""),
    *sorted(((k.label, k.name) for k in KINDS.values()), key=lambda choice: choice[1] != MENU_FIRST),
]


@dataclass(frozen=True)
class Controls:
    system: str = ""  # the system prompt
    decoding: str = "Medusa"  # a key of DECODING
    acceptance: str = ACCEPTANCE[0]  # one of ACCEPTANCE
    epsilon: float = _DEFAULT.epsilon  # typical acceptance: ε
    delta: float = _DEFAULT.delta  # typical acceptance: δ
    temperature: float = _DEFAULT.temperature
    top_p: float = _DEFAULT.top_p
    max_new_tokens: int = _DEFAULT.max_new_tokens
    tree: str = ""  # "" (auto), MODEL_TREE or a preset name
    drafter: str = ""  # "" (the tree's own) or one of core.drafters.registry.DRAFTERS
    colors: bool = True  # color each step's tokens in the chat

    @classmethod
    def of(cls, values: tuple) -> Controls:
        """The controls' values, as a handler receives them (in the order of NAMES), by name."""
        return cls(**dict(zip(NAMES, values, strict=True)))

    def settings(self) -> DecodeSettings:
        """Raises a UserError naming a value out of range."""
        return DecodeSettings(
            acceptance=self.acceptance.lower(), temperature=float(self.temperature), top_p=float(self.top_p),
            epsilon=float(self.epsilon), delta=float(self.delta), max_new_tokens=int(self.max_new_tokens),
        )  # fmt: skip

    def request(self, messages: list[dict]) -> ReplyRequest:
        """A reply to `messages` (ending with the user's message) with these settings."""
        mode = DECODING.get(self.decoding, self.decoding)
        return ReplyRequest(messages, self.settings(), self.system or "", mode, self.tree or "", self.drafter or "")


NAMES = tuple(f.name for f in fields(Controls))
DEFAULTS = asdict(Controls())  # the saved settings when there are none
