"""Invariants of app.render (and app.panels' stats): step boundaries change nothing but the spans, and nothing a reply
or a chat file holds reaches an attribute unescaped or makes the page load a remote address."""

import html
import random
import re
from html.parser import HTMLParser
from itertools import pairwise
from pathlib import Path

from app.panels import stats_html, step_html
from app.render import LEGEND, SOURCE_LABEL, reply_html, step_source, text_html
from core.decode.generate import StepEvent

LINKS = "See [a](http://example.com/x?y=1) and ![i](http://img.example/p.png) or <http://auto.example> `code`."
DOC = (
    "# Title\n\nSome *emph*, _under_ and **bold** text, ~~gone~~, x &amp; y \\* z.\n\n"
    "1. one\n2. two\n   - nested `a_b`\n\n```python\nx = 1\n\ny = 2\n```\n\n"
    "| a | b |\n|:--|--:|\n| [c](http://c.example/(d)) | 2 |\n\n> quote\nline one  \nline two\n\nSub\n---\nend."
)


def _addresses(h: str) -> list[str]:
    return re.findall(r'(?:href|src)="([^"]*)"', h)


def _text(h: str) -> str:
    return html.unescape(re.sub(r"<[^>]*>", "", h))


def _steps(h: str) -> list[int]:
    return [int(s) for s in re.findall(r'data-step="(\d+)"', h)]


def _split(text: str, cuts: list[int]) -> list[tuple[str, int]]:
    bounds = [0, *cuts, len(text)]
    return [(text[a:b], 1) for a, b in pairwise(bounds)]


def _assert_same_reply(text: str, steps: list[tuple[str, int]]) -> None:
    whole, split = reply_html([(text, 0)]), reply_html(steps)
    assert _addresses(split) == _addresses(whole), steps
    assert _text(split) == _text(whole), steps
    numbers = _steps(split)
    assert numbers == sorted(numbers), steps


def test_a_boundary_inside_a_link_image_or_autolink_changes_no_address():
    # old: the marker character was punycoded into the host ("xn--example-9w78a.com") or
    # percent-encoded, broke autolinks into text, and shifted the step numbers after it
    for i in range(1, len(LINKS)):
        steps = _split(LINKS, [i])
        _assert_same_reply(LINKS, steps)
        assert _steps(reply_html(steps))[-1] == 2  # the last step ("…`.") always has text
    one_per_char = [(c, 1) for c in LINKS]
    _assert_same_reply(LINKS, one_per_char)
    assert _steps(reply_html(one_per_char))[-1] == len(LINKS)


def test_step_numbers_after_a_link_do_not_slip():
    # old: a boundary inside the address was lost, so every later step got the number before it
    steps = [("Go [here](http://ex", 1), ("ample.com) ", 1), ("three ", 0), ("four", 2)]
    spans = re.findall(r'data-step="(\d+)"[^>]*>([^<]*)<', reply_html(steps))
    assert ("3", "three ") in spans and ("4", "four") in spans
    assert 'href="http://example.com"' in reply_html(steps)


def test_a_boundary_anywhere_keeps_lists_code_tables_and_emphasis():
    # old: a boundary in a table's |---| row or next to `_` turned them into plain text
    for i in range(1, len(DOC)):
        _assert_same_reply(DOC, _split(DOC, [i]))
    rng = random.Random(0)
    for _ in range(200):
        _assert_same_reply(DOC, _split(DOC, sorted(rng.sample(range(1, len(DOC)), rng.randint(2, 40)))))


class _Attributes(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.names |= {name for name, _ in attrs}


def _attribute_names(h: str) -> set[str]:
    parser = _Attributes()
    parser.feed(h)
    return parser.names


def test_a_crafted_chat_file_cannot_add_attributes():
    # old: accepted and source were pasted into the span as they were (and an unknown source raised KeyError)
    steps = [("a", '1" onmouseover="alert(1)'), ("b", 2, 'heads" onclick="alert(1)'), ("c", 1, ["x"])]
    out = reply_html(steps)
    assert _attribute_names(out) <= {"class", "data-step", "data-accepted", "data-source", "title"}
    assert 'data-accepted="0"' in out and 'data-source="heads"' in out
    for odd in ([], [None], ["x", float("inf")], ["x", None, None], ["x", "3"]):
        assert "data-step" in reply_html([("ok ", 1), odd, (" end", 0)])


def test_stats_show_what_a_partial_or_odd_file_holds():
    # old: stats_html({"tokens": 3}) raised KeyError: 'steps'
    assert "<th>tokens</th><td>3</td>" in stats_html({"tokens": 3}, [], [])
    out = stats_html(
        {"tokens": 4, "steps": "<b>2</b>", "finish_reason": "<i>", "sources": {"heads": 1, "<odd>": 1}}, [0, 1], [0.5]
    )
    assert "<b>" not in out and "<i>" not in out and "<odd>" not in out
    assert "from the Medusa heads</th><td>1 (25%)" in out and "&lt;odd&gt;" in out


def test_remote_images_are_links_and_never_load():
    # old: ![i](http://…) became <img src="http://…">, fetched as soon as the reply showed
    md = "![pic](http://img.example/p.png) ![](https://x.example/q.gif) [![badge](https://b.example/s.svg)](https://ci.example)"
    for out in (reply_html([(md[:9], 1), (md[9:], 0)]), text_html(md)):
        assert not re.search(r"<img[^>]*src=\"(?!data:)", out)
        assert 'href="http://img.example/p.png"' in out and "🖼" in out and "pic" in _text(out)
        assert out.count("<a ") == out.count("</a>") == 3  # the badge is not a link inside a link
    inline = "![dot](data:image/png;base64,iVBORw0KGgo=)"
    assert '<img src="data:image/png;base64,iVBORw0KGgo=" alt="dot"' in text_html(inline)


def test_links_open_without_referrer_and_javascript_stays_refused():
    # old: links had no rel, so the linked page learned the app's address and could reach window.opener
    out = reply_html([("[a](http://a.example) <http://b.example>", 0)])
    assert out.count('rel="noopener noreferrer nofollow"') == 2
    bad = "[x](javascript:alert(1)) <javascript:alert(1)> ![y](javascript:alert(1))"
    for i in range(len(bad) + 1):
        assert not any("javascript" in a.lower() for a in _addresses(reply_html(_split(bad, [i]))))


def test_markdown_still_renders_as_before():
    out = reply_html([("Para one ", 1), ("ends.\n\nPara two\n\n```py\na\n\nb\n```\n- x\n- y", 2, "context")])
    assert "\n" not in out and '<pre><code class="language-py">' in out and "a&#10;&#10;b&#10;" in _strip_spans(out)
    assert "<ul><li>" in out and out.count('data-step="2"') >= 3  # one span per paragraph, code, item
    assert "src-context" in out and "spec-colors" in out
    assert out.endswith("</div>") and "cursor" not in out
    assert "cursor" in reply_html([("a", 0)], streaming=True)
    assert "spec-plain" in reply_html([("a", 0)], colors=False)
    assert "&lt;script&gt;" in text_html("<script>alert(1)</script>")
    table = text_html("| a | b |\n|---|---|\n| 1 | 2 |")
    assert "<table><thead><tr><th>a</th>" in table and "<td>2</td>" in table


def _strip_spans(h: str) -> str:
    return re.sub(r"</?span[^>]*>", "", h)


def _event(step: int, text: str, sources: tuple[str, ...], node_sources: tuple[str, ...] = ()) -> StepEvent:
    n = len(node_sources)
    return StepEvent(
        step=step, token_ids=tuple(range(len(sources) + 1)), text=text, accepted=len(sources),
        path=tuple(range(len(sources) + 1)), draft=tuple(range(n)), tree_size=n, seconds=0.01,
        tokens_per_second=100.0, sources=sources, parents=tuple(max(0, i - 1) for i in range(n)),
        node_sources=node_sources,
    )  # fmt: skip


def test_tokens_from_the_draft_model_have_their_own_style_label_and_legend_entry():
    # old: "draft" was not a known source, so a draft model's tokens were shown as the Medusa heads'
    events = [
        _event(1, "Plain <b>start</b> ", ()),
        _event(2, "drafted <script>alert(1)</script> ", ("draft", "draft"), ("root", "draft", "draft", "context")),
        _event(3, "heads", ("heads",), ("root", "heads")),
    ]
    out = reply_html([(e.text, e.accepted, step_source(e.sources)) for e in events])
    assert step_source(("draft", "draft")) == "draft" and step_source(("draft", "both")) == "draft"
    assert re.search(r'class="st c1 src-draft" data-step="2" data-accepted="2" data-source="draft" '
                     r'title="step 2: 2 drafted tokens accepted, from the draft model"', out), out  # fmt: skip
    assert "<script>" not in out and "&lt;script&gt;" in out and "&lt;b&gt;" in out
    assert "src-draft" not in reply_html([(e.text, e.accepted, step_source(e.sources)) for e in events[::2]])
    assert 'class="st c2 src-draft"' in LEGEND and "= drafted by the draft model" in LEGEND
    inspector = step_html(events[1], ["root", "<a>", "x&y", "z"])
    assert inspector.count("src-draft") == 2 and inspector.count("<small>draft</small>") == 2
    assert "<small>ctx</small>" in inspector and "&lt;a&gt;" in inspector and "<a>" not in inspector
    stats = stats_html({"tokens": 8, "sources": {"draft": 2, "heads": 1}}, [0, 2, 1], [])
    assert "drafted: from the draft model</th><td>2 (25%)" in stats


def _decorations(css: str) -> dict[str, str]:
    """Each source's text-decoration in the reply, by source name."""
    found = re.findall(r"\.medusa-reply\.spec-colors \.st\.src-(\w+),\s*\.medusa-legend[^{]*\{([^}]*)\}", css)
    return {name: re.search(r"text-decoration:([^;]*);", rule).group(1).strip() for name, rule in found}


def test_every_source_has_a_style_of_its_own():
    decorations = _decorations((Path(__file__).parents[1] / "assets" / "ui.css").read_text(encoding="utf-8"))
    assert set(decorations) == set(SOURCE_LABEL) and "draft" in decorations
    line_styles = [
        " ".join(w for w in d.split() if not w.startswith(("rgba", "0", "1", "2", "3"))) for d in decorations.values()
    ]
    assert len(set(line_styles)) == len(line_styles), decorations  # not told apart by color alone
