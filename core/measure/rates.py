"""The switch's trials remembered between launches (`switch.Fastest`): each contender's last
trials, as (tokens, seconds) per step, in one JSON file per model, machine and drafter kind, so a
new session starts on the drafter measured fastest here last time instead of learning again in
its first reply (where a two-prompt run is mostly the learning). A file that is unreadable, for
another key or holds impossible figures is dropped, with one sentence; the new session then
learns as a first one does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

FORMAT = 1  # bump when the file's meaning changes: older files are ignored

Trials = dict[str, list[list[tuple[int, float]]]]  # per drafter: its trials, each a list of (tokens, seconds) per step


class RateMemory:
    """One kind of drafter's trials on disk under `folder`, for `key` (everything the rates depend on)."""

    def __init__(self, folder: Path, key: str, say: Callable[[str], None] = lambda s: None) -> None:
        self.key, self.say = key, say
        self.path = folder / f"switch-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def load(self, names: Iterable[str]) -> Trials:
        """The stored trials of the drafters `names` (each absent one: none); {} if there is no file
        or it cannot be used."""
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT or data.get("key") != self.key:
                raise ValueError("stale")
            trials = {name: [_steps(trial) for trial in data["trials"].get(name, [])] for name in names}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            if str(e) != "stale":
                self.say(f"The stored drafter rates {self.path.name} are damaged; measuring them again.")
            self.path.unlink(missing_ok=True)
            return {}
        return {name: kept for name, kept in trials.items() if kept}

    def save(self, trials: Mapping[str, Iterable[list[tuple[int, float]]]]) -> None:
        """Write every drafter's trials (a failure to write loses only the memory: one sentence)."""
        data = {"format": FORMAT, "key": self.key, "trials": {n: [list(t) for t in ts] for n, ts in trials.items()}}
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:
            self.say(f"Could not remember the drafters' rates in {self.path} ({e.strerror or e}).")


def _steps(trial: list) -> list[tuple[int, float]]:
    steps = [(int(t), float(s)) for t, s in trial]
    if not steps or any(t < 1 or not (math.isfinite(s) and s > 0) for t, s in steps):
        raise ValueError("impossible figures")
    return steps
