"""Replies as HTML: every decoding step's text in an element with `data-step`.

The reply is parsed as Markdown once, with an invisible marker character at each step
boundary (positions come from the step events, i.e. from token ids, never from searching the
text). Each marker names its step (`chr(_FIRST + k)` starts step k), so a marker that cannot
be shown merges its step into the one before and never shifts the numbers of later steps.

1. Placing (`_marked`): a boundary is moved, in the source, to where its marker is only text:
   out of syntax runs (``` or **) and trimmed spaces, to the word side of emphasis, past a
   line's block marker, off blank lines and |---| rows, and past the end of a link's
   `](address "title")`, an `<autolink>`, an entity or an escape.
2. Rendering: markdown-it's text, inline code and code block rules turn the markers in their
   content into spans; a marker that still reaches an address is dropped before markdown-it
   encodes or checks it (so addresses are exactly those of the reply rendered whole), and one
   in any other attribute is dropped too.

Everything handed to the chat is our own markup: raw HTML from the model (or the user) is
escaped, `javascript:` links are refused, links open in a new tab without a referrer, remote
images are shown as links (loading them would tell a server the reply), and every attribute
value is escaped or chosen from a fixed set. That is why the Chatbot's sanitizer, which would
strip `data-step`, is turned off.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml, isPunctChar, unescapeAll
from markdown_it.helpers import parseLinkDestination, parseLinkTitle
from markdown_it.renderer import RendererHTML
from markdown_it.rules_core import StateCore
from markdown_it.token import Token

_FIRST, _LAST = 0xF0000, 0xFFFFD  # plane-15 private use: never in the tokenizer's text
_MARKS = re.compile("([\U000f0000-\U000ffffd])")
PALETTE = 6  # colors cycle over this many classes
SOURCE_LABEL = {
    "heads": "from the Medusa heads",
    "context": "copied from the conversation",
    "both": "from both",
    "retrieval": "copied from the model's past replies",
    "eagle": "from the EAGLE layer",
    "draft": "from the draft model",
}
LINK_REL = "noopener noreferrer nofollow"

Step = tuple  # (text, drafted tokens accepted[, source of those drafts: one of SOURCE_LABEL's keys])


def _mark(k: int) -> str:
    return chr(_FIRST + min(k, _LAST - _FIRST))


def _unmark(s: str) -> str:
    return _MARKS.sub("", s)


class _Markdown(MarkdownIt):
    """markdown-it that drops step markers from an address before encoding (punycode, %) and checking it."""

    def normalizeLink(self, url: str) -> str:
        return super().normalizeLink(_unmark(url))

    def validateLink(self, url: str) -> bool:
        return super().validateLink(_unmark(url))


def _tidy_attributes(state: StateCore) -> None:
    """Links open in a new tab without a referrer; markers in titles and the like are dropped
    (in an attribute they would show nothing: their step merges into the one before)."""
    for token in state.tokens:
        for t in [token, *(token.children or [])]:
            t.attrs = {k: _unmark(v) if isinstance(v, str) else v for k, v in t.attrs.items()}
            if t.type == "link_open":
                t.attrs.update(rel=LINK_REL, target="_blank")


# ---- rendering: step markers become spans, only inside text ----


def _spans(content: str, env: dict) -> str:
    """Escaped text, cut into one span per step where `env` carries steps (newlines as
    entities: a raw blank line inside <pre> would end the HTML block in the chat's Markdown)."""
    if env.get("steps") is None:
        return escapeHtml(_unmark(content)).replace("\n", "&#10;")
    out = []
    for i, run in enumerate(_MARKS.split(content)):  # odd i: a marker
        if i % 2:
            env["step"] = max(env["step"], ord(run) - _FIRST)
        elif run:
            out.append(_span(escapeHtml(run).replace("\n", "&#10;"), env["step"], *env["steps"][env["step"]][1:]))
    return "".join(out)


def _text(self: RendererHTML, tokens: Sequence[Token], idx: int, options: Any, env: dict) -> str:
    return _spans(tokens[idx].content, env)


def _code_inline(self: RendererHTML, tokens: Sequence[Token], idx: int, options: Any, env: dict) -> str:
    return f"<code{self.renderAttrs(tokens[idx])}>{_spans(tokens[idx].content, env)}</code>"


def _fence(self: RendererHTML, tokens: Sequence[Token], idx: int, options: Any, env: dict) -> str:
    """Fenced or indented code; a marker in the info string (```py|thon) starts its step at the code."""
    info = unescapeAll(tokens[idx].info)
    words = _unmark(info).split()
    lang = f' class="language-{escapeHtml(words[0])}"' if words else ""
    marks = "".join(_MARKS.findall(info))
    return f"<pre><code{lang}>{_spans(marks + tokens[idx].content, env)}</code></pre>"


def _image(self: RendererHTML, tokens: Sequence[Token], idx: int, options: Any, env: dict) -> str:
    """Inline `data:` images are shown; any other address becomes a link the user may follow."""
    token = tokens[idx]
    src = str(token.attrGet("src") or "")
    if src.lower().startswith("data:"):
        token.attrSet("alt", _unmark(self.renderInlineAsText(token.children or [], options, env)))
        return self.renderToken(tokens, idx, options, env)
    label = self.renderInline(token.children or [], options, env) or escapeHtml(src)
    in_link = sum(t.nesting for t in tokens[:idx] if t.type in ("link_open", "link_close"))
    if not src or in_link:  # no address, or the link around it is the one to follow
        return f"🖼 {label}"
    title = f' title="{escapeHtml(str(token.attrGet("title")))}"' if token.attrGet("title") else ""
    return f'<a href="{escapeHtml(src)}" rel="{LINK_REL}" target="_blank"{title}>🖼 {label}</a>'


_md = _Markdown("commonmark", {"html": False, "breaks": True}).enable("table").enable("strikethrough")
_md.core.ruler.push("tidy_attributes", _tidy_attributes)
_RULES = {"text": _text, "code_inline": _code_inline, "fence": _fence, "code_block": _fence, "image": _image}
for _type, _rule in _RULES.items():
    _md.add_render_rule(_type, _rule)


def reply_html(steps: list[Step], colors: bool = True, streaming: bool = False) -> str:
    """steps: (text, drafted tokens accepted[, source]) per decoding step, in order."""
    clean = [_clean_step(s) for s in steps] or [("", 0, "heads")]
    env = {"steps": clean, "step": 0}
    body = _md.render(_marked([s[0] for s in clean]), env).replace("\n", "")  # newlines only separate tags
    mode = "spec-colors" if colors else "spec-plain"
    cursor = '<span class="cursor">▍</span>' if streaming else ""
    return f'<div class="medusa-reply {mode}">{body}{cursor}</div>'


def text_html(text: str) -> str:
    """A user's message: Markdown with raw HTML escaped, on one line like the replies."""
    body = _md.render(str(text), {}).replace("\n", "")
    return f'<div class="medusa-user">{body}</div>'


def _clean_step(step: Step) -> tuple[str, int, str]:
    """(text, accepted, source) whatever a chat file held: text without markers, accepted an
    int (0 if it is not one), source one of SOURCE_LABEL's keys."""
    step = tuple(step) if isinstance(step, (tuple, list)) else (step,)
    text = _unmark(str(step[0])) if step and step[0] is not None else ""
    try:
        accepted = max(0, int(step[1])) if len(step) > 1 else 0
    except (TypeError, ValueError, OverflowError):
        accepted = 0
    source = step[2] if len(step) > 2 else "heads"
    return text, accepted, source if isinstance(source, str) and source in SOURCE_LABEL else "heads"


def _span(text: str, step: int, accepted: int, source: str = "heads") -> str:
    """text: already escaped; accepted and source already checked by _clean_step."""
    if not accepted:
        label = f"step {step + 1}: the model's own token only"
        return f'<span class="st own" data-step="{step + 1}" data-accepted="0" title="{label}">{text}</span>'
    label = f"step {step + 1}: {accepted} drafted token{'s' if accepted != 1 else ''} accepted, {SOURCE_LABEL[source]}"
    return (
        f'<span class="st c{step % PALETTE} src-{source}" data-step="{step + 1}" data-accepted="{accepted}" '
        f'data-source="{source}" title="{label}">{text}</span>'
    )


# ---- where the step markers go in the source ----

_SYNTAX = set("`*_~#>-+=|[]()!")
_BLOCK = set(" \t0123456789.)-*+#>`~|=:")  # what may start a line as Markdown block syntax
_EMPHASIS = set("*_~")
_WHOLE = re.compile(  # nothing to cut inside: autolinks, a reference label after a link's text, entities, escapes
    r"<[A-Za-z][A-Za-z0-9.+-]{1,31}:[^<>\x00-\x20]*>|<[\w.!#$%&'*+/=?^`{|}~-]+@[\w.-]+>|\]\[[^\]\n]{0,999}\]"
    r"|&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});|\\[!-/:-@\[-`{-~]"
)
_DEFINITION = re.compile(r"^ {0,3}\[[^\]\n]+\]:[ \t]*", re.M)  # up to the address of a reference definition
_SPACE = re.compile(r"[ \t\n]*")


def _marked(texts: list[str]) -> str:
    """The reply with the marker of step k where step k begins (moved by _cut)."""
    text = "".join(texts)
    whole = _constructs(text)
    out, prev, at = [], 0, 0
    for k, t in enumerate(texts[:-1], start=1):
        at += len(t)
        p = max(_cut(text, at, whole), prev)
        out += [text[prev:p], _mark(k)]
        prev = p
    return "".join(out) + text[prev:]


def _cut(text: str, p: int, whole: list[tuple[int, int, int]]) -> int:
    """Where a boundary at p may go without changing the Markdown (the rules below), then
    where `whole` sends a boundary inside one of its constructs."""
    p = _off_delimiters(text, _off_block_syntax(text, _off_delimiters(text, _off_spaces(text, p))))
    for start, end, to in whole:
        if start < p < end:
            p = to
    return p


def _off_spaces(text: str, p: int) -> int:
    """Out of spaces that Markdown trims (at a line's or a table cell's ends): a marker there
    would keep them, and two spaces before a newline would no longer break the line."""
    start, end = p, p
    while start > 0 and text[start - 1] in " \t":
        start -= 1
    while end < len(text) and text[end] in " \t":
        end += 1
    if end == len(text) or text[end] == "\n":
        return _line_end(text, end)
    if start == end:
        return p
    if text[end] == "|":
        return start
    return end if start == 0 or text[start - 1] in "\n|" else p


def _line_end(text: str, end: int) -> int:
    """The last place on the line ending at `end` that is still text: before trailing spaces
    and before a table row's closing pipe (a marker after it would add a cell)."""
    start = text.rfind("\n", 0, end) + 1
    line = text[start:end].rstrip(" \t")
    if line.endswith("|") and not line.endswith("\\|"):
        line = line[:-1].rstrip(" \t")
    return start + len(line)


def _off_delimiters(text: str, p: int) -> int:
    """Out of a run of syntax characters (``` or **), and off the side of an emphasis run that
    faces a space or punctuation: a marker reads as a letter, so between `_` and a space it
    would stop `_` closing (and between ` * ` and a space make `*` open)."""
    while 0 < p < len(text) and text[p - 1] in _SYNTAX and text[p] in _SYNTAX:
        p += 1
    start, end = p, p
    while start > 0 and text[start - 1] in _EMPHASIS:
        start -= 1
    while end < len(text) and text[end] in _EMPHASIS:
        end += 1
    if start == end or _letter(text, p - 1 if p == start else p):
        return p
    if _letter(text, end) or _letter(text, start - 1):
        return end if _letter(text, end) else start
    return start - 1 if start > 0 and text[start - 1] in " \t" else p


def _letter(text: str, i: int) -> bool:
    return 0 <= i < len(text) and not text[i].isspace() and not isPunctChar(text[i])


def _off_block_syntax(text: str, p: int) -> int:
    """Past a line's block marker ("1. ", "- "); never onto a line of nothing but syntax or
    space (a blank line would join two paragraphs, a marker after ``` or |---| ends no block)."""
    line_start = text.rfind("\n", 0, p) + 1
    if not all(c in _BLOCK for c in text[line_start:p]):
        return p
    while p < len(text) and text[p] in _BLOCK:
        p += 1
    return p if p < len(text) and text[p] != "\n" else _end_of_content_above(text, line_start)


def _end_of_content_above(text: str, line_start: int) -> int:
    """The end of the nearest line above with more than syntax on it."""
    end = line_start - 1
    while end > 0:
        start = text.rfind("\n", 0, end) + 1
        if any(c not in _BLOCK for c in text[start:end]):
            return _line_end(text, end)
        end = start - 1
    first = text.find("\n")  # nothing above: the info string of an opening fence, or the very start
    return first if first > 0 and text.lstrip(" ").startswith(("```", "~~~")) else 0


def _constructs(text: str) -> list[tuple[int, int, int]]:
    """(start, end, where a boundary inside goes) of autolinks, reference labels, entities,
    escapes, the `](address "title")` of inline links (all: their end) and reference
    definitions (the start of the address, which markdown-it reads without the marker)."""
    found = [(*m.span(), m.end()) for m in _WHOLE.finditer(text)]
    for m in re.finditer(r"\]\(", text):
        end = _link_tail(text, m.end())
        if end:
            found.append((m.start(), end, end))
    for m in _DEFINITION.finditer(text):
        line_end = text.find("\n", m.end())
        found.append((m.start() - 1, len(text) if line_end < 0 else line_end + 1, m.end()))
    return sorted(found)


def _link_tail(text: str, pos: int) -> int | None:
    """The end of `address "title")` starting at pos, as markdown-it's link rule reads it."""
    pos = _SPACE.match(text, pos).end()
    dest = parseLinkDestination(text, pos, len(text))
    if dest.ok:
        after = _SPACE.match(text, dest.pos).end()
        title = parseLinkTitle(text, after, len(text))
        pos = _SPACE.match(text, title.pos).end() if after != dest.pos and title.ok else after
    return pos + 1 if pos < len(text) and text[pos] == ")" else None


# ---- what a step's colors say ----


def step_source(sources: tuple[str, ...]) -> str:
    """One label for a step's accepted drafts: "context", "retrieval", "eagle" or "draft" when that
    source proposed them all (some also by the heads), "heads" when the heads did, "both" when both
    did throughout."""
    kinds = set(sources)
    if not kinds or kinds == {"both"}:
        return "both" if kinds else ""
    for lookup in ("context", "retrieval", "eagle", "draft"):
        if kinds <= {lookup, "both"}:
            return lookup
    return "heads"


LEGEND = (
    '<div class="medusa-legend">'
    '<span class="st own">plain text</span> = a step where only the model\'s own next token was kept; '
    '<span class="st c1 src-heads">colored</span> <span class="st c2 src-heads">runs</span> = one step each '
    "that also accepted drafted tokens (the color changes from step to step): "
    '<span class="st c3 src-heads">solid underline</span> = drafted by the Medusa heads, '
    '<span class="st c4 src-context">dashed underline</span> = copied from the conversation, '
    '<span class="st c5 src-both">double underline</span> = proposed by both, '
    '<span class="st c0 src-retrieval">dotted underline</span> = copied from the model\'s past replies, '
    '<span class="st c1 src-eagle">wavy underline</span> = drafted by the EAGLE layer, '
    '<span class="st c2 src-draft">lined above and below</span> = drafted by the draft model. '
    "Hover a run for its step.</div>"
)
