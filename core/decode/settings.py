"""Decoding settings: one frozen dataclass, validated once, shared by every loop and mode."""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.decode.acceptance import check_typical
from core.errors import UserError

ACCEPTANCE_RULES = ("lossless", "typical")
MODES = ("medusa", "baseline")  # tree decoding with a drafter, or the plain one-token loop


@dataclass(frozen=True)
class DecodeSettings:
    acceptance: str = "lossless"  # "lossless" keeps the backbone's distribution; "typical" trades it for speed
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass (1.0 = off); used by lossless sampling
    top_k: int = 0  # keep the k most likely tokens (0 = off); used by lossless sampling
    epsilon: float = 0.09  # typical: hard probability threshold ε
    delta: float = 0.3  # typical: entropy-scaled threshold δ·exp(−H)
    max_new_tokens: int = 256  # reply length limit
    stop: tuple[str, ...] = ()  # stop strings (the reply is cut before them)

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE_RULES:
            raise UserError(f"Acceptance must be lossless or typical, got '{self.acceptance}'.")
        if not 0 <= self.temperature < math.inf:
            raise UserError(f"Temperature must be a finite number ≥ 0 (0 is greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}; 1 turns it off.")
        if self.top_k < 0:
            raise UserError(f"top-k must be ≥ 0, got {self.top_k}; 0 turns it off.")
        if self.max_new_tokens < 1:
            raise UserError(f"max new tokens must be at least 1, got {self.max_new_tokens}.")
        if not all(self.stop):
            raise UserError("A stop string must not be empty: it would end every reply at its first token.")
        check_typical(self.epsilon, self.delta)
