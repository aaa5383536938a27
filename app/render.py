"""Replies and stats as HTML: every decoding step's text in an element with `data-step`.

The reply is rendered as Markdown once, with an invisible marker character placed at each
step boundary (positions come from the step events, i.e. from token ids, never from searching
the text). The markers then split the rendered text into spans, so lists, code fences and
line breaks render normally and a step that crosses a paragraph or a code line simply gets
one span in each. Raw HTML written by the model (or typed by the user) is escaped and
`javascript:` links are refused by markdown-it, so everything handed to the chat is our own
markup: that is why the Chatbot's sanitizer, which would strip `data-step`, is turned off.
"""

from __future__ import annotations

import html
import re

from markdown_it import MarkdownIt

MARK = "\ue000"  # private-use character: never produced by the tokenizer's text
PALETTE = 6  # colors cycle over this many classes
_md = MarkdownIt("commonmark", {"html": False, "breaks": True}).enable("table").enable("strikethrough")
_TAG = re.compile(r"(<[^>]*>)")


Step = tuple  # (text, drafted tokens accepted[, source of those drafts: "heads", "context" or "both"])


def reply_html(steps: list[Step], colors: bool = True, streaming: bool = False) -> str:
    """steps: (text, drafted tokens accepted[, source]) per decoding step, in order."""
    rendered = _md.render(_marked(steps))
    out, step, in_pre = [], 0, False
    for piece in _TAG.split(rendered):
        if piece.startswith("<"):
            step += piece.count(MARK)  # a boundary inside an attribute (e.g. a link) still counts
            in_pre = piece.startswith("<pre") or (in_pre and not piece.startswith("</pre"))
            out.append(piece.replace(MARK, ""))
            continue
        for i, run in enumerate(piece.split(MARK)):
            step += i > 0
            # code keeps its lines (as entities: a raw blank line would end the HTML block in the
            # chat's Markdown); elsewhere newlines are only formatting between tags
            run = run.replace("\n", "&#10;" if in_pre else "")
            if run:
                info = steps[step] if 0 <= step < len(steps) else ("", 0)
                out.append(_span(run, step, info[1], info[2] if len(info) > 2 else "heads"))
    body = "".join(out).replace("\n", "")
    mode = "spec-colors" if colors else "spec-plain"
    cursor = '<span class="cursor">▍</span>' if streaming else ""
    return f'<div class="medusa-reply {mode}">{body}{cursor}</div>'


_SYNTAX = set("`*_~#>-+=|[]()!")
_BLOCK = set(" \t0123456789.)-*+#>`~|")  # what may start a line as Markdown block syntax


def _marked(steps: list[Step]) -> str:
    """The reply with MARK at each step boundary, nudged so it never breaks Markdown syntax:
    out of a run of syntax characters (``` or **), past a line's block marker ("1. ", "- ",
    "## "), and never onto a blank line (which would join two paragraphs)."""
    text = "".join(s[0] for s in steps)
    cuts, at = [], 0
    for t, *_ in steps[:-1]:
        at += len(t)
        p = at
        while 0 < p < len(text) and text[p - 1] in _SYNTAX and text[p] in _SYNTAX:
            p += 1
        line_start = text.rfind("\n", 0, p) + 1
        if all(c in _BLOCK for c in text[line_start:p]):
            while p < len(text) and text[p] in _BLOCK:
                p += 1
            if p == len(text) or text[p] == "\n":  # nothing but syntax or space: end of the line above
                p = line_start - 1 if line_start else 0
                while p > 0 and text[p - 1] == "\n":
                    p -= 1
        cuts.append(p)
    out, prev = [], 0
    for p in cuts:
        p = max(p, prev)
        out += [text[prev:p], MARK]
        prev = p
    return "".join(out) + text[prev:]


def text_html(text: str) -> str:
    """A user's message: Markdown with raw HTML escaped, on one line like the replies."""
    return f'<div class="medusa-user">{_one_line(_md.render(text))}</div>'


def _one_line(rendered: str) -> str:
    """Newlines kept inside <pre> as entities, dropped elsewhere (they only separate tags)."""
    out, in_pre = [], False
    for piece in _TAG.split(rendered):
        if piece.startswith("<"):
            in_pre = piece.startswith("<pre") or (in_pre and not piece.startswith("</pre"))
            out.append(piece)
        else:
            out.append(piece.replace("\n", "&#10;" if in_pre else ""))
    return "".join(out)


SOURCE_LABEL = {"heads": "from the Medusa heads", "context": "copied from the conversation", "both": "from both"}


def step_source(sources: tuple[str, ...]) -> str:
    """One label for a step's accepted drafts: "context" when the context proposed them all
    (some also by the heads), "heads" when the heads did, "both" when both did throughout."""
    kinds = set(sources)
    if not kinds or kinds == {"both"}:
        return "both" if kinds else ""
    return "context" if kinds <= {"context", "both"} else "heads"


def _span(text: str, step: int, accepted: int, source: str = "heads") -> str:
    if not accepted:
        label = f"step {step + 1}: the model's own token only"
        return f'<span class="st own" data-step="{step + 1}" data-accepted="0" title="{label}">{text}</span>'
    source = source or "heads"
    label = f"step {step + 1}: {accepted} drafted token{'s' if accepted != 1 else ''} accepted, {SOURCE_LABEL[source]}"
    return (
        f'<span class="st c{step % PALETTE} src-{source}" data-step="{step + 1}" data-accepted="{accepted}" '
        f'data-source="{source}" title="{label}">{text}</span>'
    )


LEGEND = (
    '<div class="medusa-legend">'
    '<span class="st own">plain text</span> = a step where only the model\'s own next token was kept; '
    '<span class="st c1 src-heads">colored</span> <span class="st c2 src-heads">runs</span> = one step each '
    "that also accepted drafted tokens (the color changes from step to step): "
    '<span class="st c3 src-heads">solid underline</span> = drafted by the Medusa heads, '
    '<span class="st c4 src-context">dashed underline</span> = copied from the conversation, '
    '<span class="st c5 src-both">double underline</span> = proposed by both. Hover a run for its step.</div>'
)


def source_shares(stats: dict) -> list[tuple[str, str]]:
    """Rows giving the share of the reply's tokens by origin (when drafts were accepted)."""
    counts = stats.get("sources") or {}
    total = stats.get("tokens") or 0
    if not total or not any(counts.values()):
        return []
    own = total - sum(counts.values())
    rows = [("model's own tokens", own)] + [(f"drafted: {SOURCE_LABEL[k]}", counts.get(k, 0)) for k in SOURCE_LABEL]
    return [(label, f"{n} ({100 * n / total:.0f}%)") for label, n in rows]


def stats_html(stats: dict, accepted: list[int], depth_rates: list[float]) -> str:
    """Numbers of one reply, a histogram of accepted drafts per step, acceptance per depth."""
    if not stats:
        return '<div class="medusa-stats">No reply yet.</div>'
    rows = [
        ("tokens", f"{stats['tokens']}"),
        ("steps", f"{stats['steps']}"),
        ("tokens / step", f"{stats['tokens_per_step']:.2f}"),
        ("tokens / s", f"{stats['tokens_per_second']:.1f}"),
        ("first token", f"{1000 * stats['first_token_seconds']:.0f} ms"),
        ("finished by", html.escape(stats["finish_reason"])),
        *([("drafter", html.escape(stats["drafter"]))] if stats.get("drafter") else []),
        *source_shares(stats),
    ]
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
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
    node i came from ("heads", "context", "both")."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(i)
    on_path = set(accepted_path)
    tag = {"heads": "", "context": "ctx", "both": "both"}

    def node(i: int) -> str:
        cls = "node accepted" if i in on_path else "node"
        kind = sources[i] if i < len(sources) else ("root" if i == 0 else "heads")
        note = "root" if i == 0 else tag.get(kind, "")
        small = f"<small>{note}</small> " if note else ""
        label = f'<span class="{cls} src-{kind}">{small}{html.escape(repr(tokens[i]))}</span>'
        kids = "".join(node(c) for c in children.get(i, []))
        return f"<li>{label}{f'<ul>{kids}</ul>' if kids else ''}</li>"

    return f'<div class="medusa-tree"><ul>{node(0)}</ul></div>'
