"""The side panels' HTML: one reply's stats, the step inspector's candidate tree, and the
comparison with plain decoding. The reply itself is `app.render`'s.

Texts from a chat file or the model are escaped here: the page shows this markup as it is.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from app.render import SOURCE_LABEL

if TYPE_CHECKING:
    from core.decode.generate import Finished, StepEvent


def _count(value: Any) -> int:
    """A count from a chat file: 0 unless it is a number."""
    return int(value) if isinstance(value, (int, float)) and value == value and abs(value) != float("inf") else 0


def source_shares(stats: dict) -> list[tuple[str, str]]:
    """Rows giving the share of the reply's tokens by origin (when drafts were accepted)."""
    counts = stats.get("sources")
    counts = {str(k): _count(n) for k, n in counts.items()} if isinstance(counts, dict) else {}
    total = _count(stats.get("tokens"))
    if not total or not any(counts.values()):
        return []
    own = total - sum(counts.values())
    rows = [("model's own tokens", own)] + [(f"drafted: {SOURCE_LABEL[k]}", counts.get(k, 0)) for k in SOURCE_LABEL]
    rows += [(f"drafted: {html.escape(k)}", n) for k, n in counts.items() if k not in SOURCE_LABEL]
    return [(label, f"{n} ({100 * n / total:.0f}%)") for label, n in rows]


_STAT_ROWS = (  # key in the stats, its label, how a number is shown
    ("tokens", "tokens", "{}".format),
    ("steps", "steps", "{}".format),
    ("tokens_per_step", "tokens / step", "{:.2f}".format),
    ("tokens_per_second", "tokens / s", "{:.1f}".format),
    ("first_token_seconds", "first token", lambda s: f"{1000 * s:.0f} ms"),
    ("prompt_read", "prompt tokens read", "{}".format),
    ("prompt_reused", "prompt tokens reused", "{}".format),
    ("finish_reason", "finished by", str),
    ("drafter", "drafter", str),
)


def _stat(value: Any, number: Any) -> str:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number(value) if is_number else html.escape(str(value))


def stats_html(stats: dict, accepted: list[int], depth_rates: list[float]) -> str:
    """Numbers of one reply (those it has), a histogram of accepted drafts per step,
    acceptance per depth."""
    if not stats or not isinstance(stats, dict):
        return '<div class="medusa-stats">No reply yet.</div>'
    rows = [(label, _stat(stats[k], number)) for k, label, number in _STAT_ROWS if stats.get(k) not in (None, "")]
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows + source_shares(stats))
    counts = [accepted.count(k) for k in range(max(accepted, default=0) + 1)]
    top = max(counts, default=1) or 1
    bars = "".join(
        f'<div class="bar"><span class="label">{k}</span>'
        f'<span class="fill" style="width:{100 * n / top:.0f}%"></span><span class="n">{n}</span></div>'
        for k, n in enumerate(counts)
    )
    depths = "".join(
        f'<div class="bar"><span class="label">{d + 1}</span>'
        f'<span class="fill depth" style="width:{100 * r:.0f}%"></span><span class="n">{100 * r:.0f}%</span></div>'
        for d, r in enumerate(depth_rates)
    )
    return (
        f'<div class="medusa-stats"><table>{table}</table>'
        f"<h4>Drafted tokens accepted per step</h4>{bars}"
        f"<h4>Acceptance rate by tree depth</h4>{depths or '<p>No drafts.</p>'}</div>"
    )


def depth_rates(accepted: list[int], max_depth: int) -> list[float]:
    """Share of steps (after the prefill) that accepted at least d drafted tokens, d = 1…max_depth."""
    decode = accepted[1:]
    if not decode:
        return []
    return [sum(a >= d for a in decode) / len(decode) for d in range(1, max_depth + 1)]


def tree_html(
    parents: tuple[int, ...], tokens: list[str], accepted_path: tuple[int, ...], sources: tuple[str, ...] = ()
) -> str:
    """The candidate tree of one step as nested lists; the accepted path highlighted.

    tokens[i] is the text of node i (node 0 the root, its own parent); sources[i] says where
    node i came from ("heads", "context", "both", "retrieval", "eagle", "draft")."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(i)
    on_path = set(accepted_path)
    tag = {"heads": "", "context": "ctx", "both": "both", "retrieval": "past", "eagle": "eagle", "draft": "draft"}

    def node(i: int) -> str:
        cls = "node accepted" if i in on_path else "node"
        kind = sources[i] if i < len(sources) else ("root" if i == 0 else "heads")
        kind = kind if kind in (*tag, "root") else "heads"
        note = "root" if i == 0 else tag.get(kind, "")
        small = f"<small>{note}</small> " if note else ""
        label = f'<span class="{cls} src-{kind}">{small}{html.escape(repr(tokens[i]))}</span>'
        kids = "".join(node(c) for c in children.get(i, []))
        return f"<li>{label}{f'<ul>{kids}</ul>' if kids else ''}</li>"

    return f'<div class="medusa-tree"><ul>{node(0)}</ul></div>'


def step_html(e: StepEvent, tokens: list[str]) -> str:
    """The step inspector for step `e`: what was verified and accepted, the policy's reason next
    to what happened, then the candidate tree (tokens[i]: the text of drafted token i)."""
    if not e.draft:
        return f"<p>Step {e.step} is the prefill: the model's first token, no tree.</p>"
    head = f"<p>Step {e.step}: {e.tree_size} candidates verified, {e.accepted} drafted accepted.</p>"
    if e.choice:  # the policy's reason and its expectation, next to what happened
        head += html.escape(
            f"Policy: {e.choice} (expected {e.expected_tokens:.2f} tokens in {e.expected_ms:.1f} ms; "
            f"got {len(e.token_ids)} in {1000 * e.seconds:.1f} ms)."
        ).join(("<p>", "</p>"))
    return head + tree_html(e.parents, tokens, e.path, e.node_sources)


def compare_html(stats: dict, plain: Finished) -> str:
    """The last reply's speed (its stats) beside the same prompt decoded plainly."""
    speedup = stats["tokens_per_second"] / plain.tokens_per_second if plain.tokens_per_second else 0
    return (
        f'<div class="medusa-compare"><b>{stats["mode"]}</b>: {stats["tokens_per_second"]:.1f} tokens/s, '
        f"{stats['tokens_per_step']:.2f} tokens/step · <b>Plain</b>: {plain.tokens_per_second:.1f} tokens/s, "
        f"1.00 tokens/step · <b>speedup {speedup:.2f}×</b></div>"
    )
