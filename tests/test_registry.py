"""The drafter contract (`core.drafters.base`) and the one table of drafter kinds (`core.drafters.registry`):
what each kind needs, what it is built into, and the names every front end offers."""

from __future__ import annotations

import pytest
import torch

from app.controls import DRAFTER_MENU
from core.decode.tree import build_tree, load_preset
from core.drafters import registry
from core.drafters.auto import AutoDrafter
from core.drafters.base import Draft, Drafter, NoDrafter
from core.drafters.build import auto_drafter, make_drafter
from core.drafters.draft_model import MISSING, DraftModel, DraftModelDrafter
from core.drafters.eagle import EagleDraft
from core.drafters.eagle_tree import EagleDrafter
from core.drafters.fixed import LookupDrafter, MedusaDrafter
from core.drafters.retrieval import Corpus, SuffixIndex
from core.drafters.switch import Fastest
from core.errors import UserError
from tests.helpers import tiny_backend, tiny_model
from tests.test_engine import random_heads


class Chain(Drafter):
    """The contract's minimum: `propose` alone."""

    def propose(self, hidden, root, history=()) -> Draft:
        return Draft(root.view(1), build_tree([]))


class Reader(Chain):
    reads_features = True


def test_the_contract_has_a_harmless_default_for_everything_but_propose():
    plain = Chain()
    assert plain.taps == () and not plain.reads_features and plain.last_choice is None
    plain.feed(torch.zeros(2, 4), torch.tensor([1, 2]), 0)
    plain.observe(plain.propose(None, torch.tensor(3)), [3], 0.01)
    assert plain.rewind([1, 2, 3], 2) == 2  # keeps all it is told
    assert Reader().rewind([1, 2, 3], 2) == 0  # a feature reader that cannot say is fed the prompt again
    with pytest.raises(TypeError):
        Drafter()


def test_the_table_says_what_each_kind_needs():
    rows = registry.KINDS
    assert registry.DRAFTERS == ("medusa", "lookup", "retrieval", "hybrid", "eagle", "draft")
    assert [k for k in rows if rows[k].heads] == ["medusa", "hybrid"]
    assert [k for k in rows if rows[k].context] == ["lookup", "hybrid", "eagle", "draft"]
    assert [k for k in rows if rows[k].retrieval] == ["retrieval", "hybrid", "eagle", "draft"]
    assert {k: (rows[k].eagle, rows[k].draft) for k in rows if (rows[k].eagle, rows[k].draft) != ("no", "no")} == {
        "hybrid": ("optional", "optional"), "eagle": ("required", "no"), "draft": ("no", "required"),
    }  # fmt: skip
    assert registry.needs(["eagle"], auto=False) == registry.Needs(eagle=True, eagle_if_any=True, corpus=True)
    for auto in (False, True):  # a draft model must be given, with or without the policy
        assert registry.needs(["draft"], auto=auto) == registry.Needs(corpus=True, draft=True)
    assert registry.needs(["hybrid"], auto=True) == registry.Needs(heads=True, eagle_if_any=True, corpus=True)
    assert registry.needs(["hybrid"], auto=False) == registry.Needs(heads=True, corpus=True)
    assert registry.needs(["lookup"], auto=True) | registry.needs(["medusa"], auto=False) == registry.Needs(heads=True)
    assert registry.needs([], auto=True) == registry.Needs()


def test_how_far_each_kind_reaches():
    assert {k: registry.kind(k).reach(5, 7) for k in registry.DRAFTERS} == {
        "medusa": 5, "lookup": 7, "retrieval": 7, "hybrid": 7, "eagle": 7, "draft": 7,
    }  # fmt: skip
    assert {k: registry.kind(k).reach(5, 3) for k in registry.DRAFTERS} == {
        "medusa": 5, "lookup": 3, "retrieval": 5, "hybrid": 5, "eagle": 5, "draft": 5,
    }  # fmt: skip


def test_an_unknown_kind_is_one_sentence_naming_the_choices(tmp_path):
    with pytest.raises(UserError, match=r"Unknown drafter 'nope'; choose one of medusa, lookup, retrieval"):
        registry.kind("nope")
    with pytest.raises(UserError, match="Unknown drafter"):
        make_drafter("nope", None, build_tree([[0]]))
    bad = tmp_path / "bad.json"
    bad.write_text('{"paths": [[0]], "drafter": "nope"}')
    with pytest.raises(UserError, match="bad drafter"):
        load_preset(str(bad))


def test_every_kind_builds_on_a_fixed_tree_and_under_the_policy():
    model = tiny_model("llama")
    heads, tree, preset = random_heads(model), build_tree([[0], [1], [0, 0]]), load_preset("cpu-8")
    corpus = Corpus(SuffixIndex([[1, 2, 3, 4, 5]]))
    eagle = EagleDraft(model, torch.arange(96)).eval()
    draft = DraftModel("tiny", tiny_backend("llama", seed=1), 96)
    fixed = {k: make_drafter(k, heads, tree, corpus=corpus, eagle=eagle, draft=draft) for k in registry.DRAFTERS}
    assert {k: type(d) for k, d in fixed.items()} == {
        "medusa": MedusaDrafter, "lookup": LookupDrafter, "retrieval": LookupDrafter, "hybrid": LookupDrafter,
        "eagle": EagleDrafter, "draft": DraftModelDrafter,
    }  # fmt: skip
    assert fixed["lookup"].corpus is None and fixed["retrieval"].index is None and fixed["hybrid"].base is not None
    assert fixed["draft"].backend is draft.backend and fixed["draft"].fixed_budget == tree.size - 1
    assert fixed["draft"].corpus is corpus and fixed["draft"].index is not None  # both lookups
    policy = {
        k: auto_drafter(k, heads, lambda: None, preset, corpus=corpus, eagle=eagle, draft=draft)
        for k in registry.DRAFTERS
    }
    assert {k: type(d) for k, d in policy.items()} == {
        "medusa": AutoDrafter, "lookup": AutoDrafter, "retrieval": AutoDrafter, "hybrid": Fastest,
        "eagle": EagleDrafter, "draft": DraftModelDrafter,
    }  # fmt: skip
    assert policy["draft"].fixed_budget is None and policy["draft"].corpus is corpus
    assert list(policy["hybrid"].drafters) == ["draft", "heads", "eagle", "plain"]  # raced, the named draft first
    assert policy["hybrid"].reference == "plain" and type(policy["hybrid"].drafters["draft"]) is DraftModelDrafter
    only_draft = auto_drafter("hybrid", heads, lambda: None, preset, corpus=corpus, draft=draft)
    assert {k: type(d) for k, d in only_draft.drafters.items()} == {
        "heads": AutoDrafter, "draft": DraftModelDrafter, "plain": NoDrafter,
    }  # fmt: skip
    assert type(auto_drafter("hybrid", heads, lambda: None, preset, corpus=corpus)) is AutoDrafter  # neither
    for kind in ("medusa", "lookup", "retrieval"):  # the draft model is raced only where the row allows it
        assert type(auto_drafter(kind, heads, lambda: None, preset, corpus=corpus, draft=draft)) is AutoDrafter
    assert all(isinstance(d, Drafter) for d in [*fixed.values(), *policy.values(), NoDrafter()])
    assert policy["hybrid"].reads_features and not fixed["hybrid"].reads_features
    with pytest.raises(UserError, match="No EAGLE drafter"):
        make_drafter("eagle", heads, tree)
    for build in (lambda: make_drafter("draft", heads, tree), lambda: auto_drafter("draft", heads, None, preset)):
        with pytest.raises(UserError) as refused:
            build()
        assert str(refused.value) == MISSING


def test_the_front_ends_offer_the_tables_kinds():
    assert [kind for _, kind in DRAFTER_MENU] == ["", "hybrid", "medusa", "lookup", "retrieval", "eagle", "draft"]
    assert dict(DRAFTER_MENU)["Draft model + context + past replies"] == "draft"
    assert registry.help_text() == (
        "medusa: heads; lookup: copies from the conversation; retrieval: copies from the model's past replies; "
        "hybrid: all in one tree; eagle: an EAGLE draft layer and both lookups; "
        "draft: a draft model (--draft-model) and both lookups (default: the tree's)"
    )
