"""Drafters built by kind, from their row in `registry.KINDS`: on a fixed tree preset
(`make_drafter`), or with each step's tree chosen by the speculation policy (`auto_drafter`).

What a kind drafts from decides what it is made of: the heads fill a fixed tree
(`MedusaDrafter`) or the policy's (`AutoDrafter`); the lookups graft copied continuations under
the root (`LookupDrafter` on a fixed tree, the policy's own lookups otherwise); the EAGLE layer
grows its own tree (`EagleDrafter`); an OPTIONAL EAGLE layer races the heads' tree and plain
decoding (`switch.Fastest`).
"""

from __future__ import annotations

from collections.abc import Callable

from core.decode.tree import Preset, TreeBuffers
from core.drafters import registry
from core.drafters.auto import AutoDrafter
from core.drafters.base import Drafter, NoDrafter
from core.drafters.draft_model import DraftModel, draft_model_drafter
from core.drafters.eagle import EagleDraft
from core.drafters.eagle_tree import eagle_drafter
from core.drafters.estimates import CostCurve
from core.drafters.fixed import Heads, LookupDrafter, MedusaDrafter
from core.drafters.policy import Policy, prior_accuracy
from core.drafters.retrieval import Corpus
from core.drafters.switch import Fastest
from core.errors import UserError
from core.measure.rates import RateMemory


def make_drafter(
    kind: str,
    heads: Heads | None,
    tree: TreeBuffers,
    tree_name: str = "the tree",
    branches: int = 2,
    length: int = 4,
    corpus: Corpus | None = None,
    eagle: EagleDraft | None = None,
    draft: DraftModel | None = None,
) -> Drafter:
    """The drafter called `kind` (one of `registry.DRAFTERS`) on the fixed tree `tree`; `corpus`:
    the past replies a kind that retrieves copies from (None: none); `eagle`, `draft`: the EAGLE
    draft layer or the draft model a kind that requires it drafts with, up to as many nodes as
    `tree` has."""
    row = registry.kind(kind)
    corpus = corpus if row.retrieval else None
    if row.draft == registry.REQUIRED:
        return draft_model_drafter(draft, corpus=corpus, budget=tree.size - 1, branches=branches, length=length)
    if row.eagle == registry.REQUIRED:
        return eagle_drafter(eagle, corpus=corpus, budget=tree.size - 1, branches=branches, length=length)
    if not row.heads:
        return LookupDrafter(None, branches, length, corpus=corpus, context=row.context)
    if not row.copies and tree.size == 1:
        raise UserError(
            f"{tree_name} has no paths, so the heads would draft nothing; choose a tree with paths such as "
            "[[0], [1], [0, 0]], or plain decoding (--mode baseline)."
        )
    medusa = MedusaDrafter(heads, tree, tree_name=tree_name)
    return LookupDrafter(medusa, branches, length, corpus=corpus, context=row.context) if row.copies else medusa


def auto_drafter(
    kind: str,
    heads,
    curve: Callable[[], CostCurve | None],
    preset: Preset,
    trained: bool = True,
    corpus: Corpus | None = None,
    eagle: EagleDraft | None = None,
    draft: DraftModel | None = None,
    memory: RateMemory | None = None,
) -> Drafter:
    """The policy-driven drafter for `kind`: the heads (if it drafts with them) with their prior
    from `preset`'s calibration (untrained ones start near 0, and draft only in a kind that copies
    nothing), the context and the past replies in `corpus` (if it copies from them), each step's
    tree chosen from the costs `curve()`. A kind that requires the EAGLE layer `eagle` drafts with
    it and both lookups, its node count chosen from the costs; one for which it is OPTIONAL runs
    whichever of the two decodes faster on this machine, measured as it runs, where the model has a
    layer. The same for the draft model `draft`. `memory`: where that race's trials are remembered
    between launches (`core.measure.rates`)."""
    row = registry.kind(kind)
    if row.eagle == registry.REQUIRED:
        return eagle_drafter(eagle, curve, corpus if row.retrieval else None)
    if row.draft == registry.REQUIRED:
        return draft_model_drafter(draft, curve, corpus if row.retrieval else None)
    optional = {
        "eagle": eagle if row.eagle == registry.OPTIONAL else None,
        "draft": draft if row.draft == registry.OPTIONAL else None,
    }
    if any(v is not None for v in optional.values()):
        # a draft model the user named comes first (it runs until another is measurably faster)
        contenders: dict[str, Drafter] = {}
        if optional["draft"] is not None:
            contenders["draft"] = draft_model_drafter(draft, curve, corpus)
        contenders["heads"] = auto_drafter(kind, heads, curve, preset, trained, corpus)
        if optional["eagle"] is not None:
            contenders["eagle"] = eagle_drafter(eagle, curve, corpus)
        # a tree runs once measurably faster than plain decoding, the reference
        return Fastest(contenders | {"plain": NoDrafter()}, reference="plain", memory=memory)
    # untrained heads (Medusa's identity init: each head the lm_head on the same hidden state) guess
    # the root's token again at every depth; where the lookups draft (they copy repeats), the heads
    # would only add their lm_head's cost to the steps that try them
    use_heads = row.heads and heads is not None and (trained or not row.copies)
    prior = None
    if use_heads:
        prior = prior_accuracy(heads.num_heads, preset.top1, preset.top10) if trained else None
        prior = prior if prior is not None else prior_accuracy(heads.num_heads, [0.02] * heads.num_heads)
    reliability = preset.reliability if use_heads and trained else ()
    use_retrieval = row.retrieval and corpus is not None and len(corpus) > 0
    rates = corpus.hit_rates if corpus is not None else ()
    policy = Policy(curve, prior, use_heads, row.context, reliability, use_retrieval, rates)
    return AutoDrafter(heads, policy, preset.lookup_branches, preset.lookup_length, corpus=corpus)
