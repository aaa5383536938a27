"""The GPU path, checked on a CPU: every drafter's drafts, trees and positions on the model's device.

Two stand-ins for a GPU: the `meta` device (tensors without values) for the draft and tree
plumbing, where a tensor left on the CPU is seen at once; and `tests.virtual_device`, a torch
function mode that puts the model on a virtual cuda:0 and fails on any op a real GPU would
refuse (devices mixed, CPU kernels reading GPU memory), for whole replies through the engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from core.backends.torch import TorchBackend
from core.decode.settings import DecodeSettings
from core.decode.step import prefill, tree_mask, verify
from core.decode.tree import AUTO, load_preset
from core.drafters.base import Draft, NoDrafter
from core.drafters.build import make_drafter
from core.drafters.draft_model import DraftModel
from core.drafters.eagle import EagleDraft, init_from_backbone
from core.drafters.eagle_tree import eagle_drafter
from core.drafters.registry import DRAFTERS
from core.drafters.retrieval import Corpus, SuffixIndex
from models.heads import MedusaHeads
from tests.helpers import tiny_model
from tests.virtual_device import GPU, DeviceMixed, VirtualCuda, VirtualGenerator, place

VOCAB = 96
TREE_BUFFERS = ("depth", "parent", "rank", "visible", "children")
SEEN = [5, 6, 7, 8, 9, 10, 11, 12]  # the corpus's past reply, which the retrieval drafters copy from


def random_heads(model, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(model.config.hidden_size, VOCAB, 4, 1, model.lm_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return heads.eval()


def eagle_layer(model) -> EagleDraft:
    draft = EagleDraft(model, torch.arange(VOCAB))
    init_from_backbone(draft, model)
    return draft.eval()


def corpus() -> Corpus:
    return Corpus(SuffixIndex([SEEN, [40, 41, 42, 43, 44, 45]]))


def every_pair() -> Corpus:
    """Past replies that go on after every pair of tokens, trusted by the policy: retrieval finds
    a continuation at every step, whatever the reply."""
    docs = [
        [a, b, (a + b) % VOCAB, (a + 2 * b) % VOCAB, (3 * a + b) % VOCAB] for a in range(VOCAB) for b in range(VOCAB)
    ]
    return Corpus(SuffixIndex(docs), hit_rates=(0.9,) * 5)


# -- the draft and tree plumbing on the meta device ----------------------------------------------


def off_device(draft: Draft, device: torch.device) -> list[str]:
    """The draft's tensors that are not on `device` (its tokens, and the tree buffers that become
    the verify forward's positions and mask)."""
    tensors = {"tokens": draft.tokens} | {f"tree.{n}": getattr(draft.tree, n) for n in TREE_BUFFERS}
    return [f"{name} on {t.device}" for name, t in tensors.items() if t.device != device]


def draft_model(dtype: torch.dtype = torch.float32, virtual_gpu: bool = False) -> DraftModel:
    """A second tiny model of the same vocabulary as a draft model (on the virtual GPU: `place`d)."""
    model = tiny_model("llama", vocab=VOCAB, seed=1).to(dtype)
    return DraftModel("tiny draft", TorchBackend(place(model) if virtual_gpu else model), VOCAB)


def meta_drafters(model, heads, eagle) -> dict[str, object]:
    """Every drafter kind as the engine builds it (fixed trees moved to the model's device), and
    the EAGLE drafter whose tree the costs choose: name → a function building it. The draft model
    runs on the CPU (a draft on another device than the model's: its tree must still reach the model's)."""
    tree = load_preset("cpu-8").tree.to(model.device)
    draft = draft_model()
    drafters = {
        kind: lambda kind=kind: make_drafter(
            kind, heads, tree, corpus=corpus(), eagle=eagle, branches=2, length=4, draft=draft
        )
        for kind in DRAFTERS
    }
    return drafters | {"eagle (auto)": lambda: eagle_drafter(eagle, corpus=corpus()), "plain": NoDrafter}


def meta_problems(model, make, hidden: Tensor, root: Tensor, history: list[int]) -> list[str]:
    """What is not on the model's (meta) device when a drafter drafts and its tree is verified."""
    try:
        draft = make().propose(hidden, root, history)
        backend = TorchBackend(model)
        cache = backend.new_cache()
        with torch.inference_mode():
            prefill(backend, cache, torch.zeros(4, dtype=torch.long, device=model.device))
            mask = tree_mask(backend, draft, backend.length(cache))
            verify(backend, cache, draft)  # positions and mask meet the model's own tensors
    except (RuntimeError, NotImplementedError) as e:  # a tensor with values where there are none, or devices mixed
        return [f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160]}"]
    return off_device(draft, model.device) + ([f"mask on {mask.device}"] if mask is not None and mask.is_cpu else [])


def test_every_drafter_drafts_on_the_model_device_meta():
    model = tiny_model("llama", vocab=VOCAB)
    heads, eagle = random_heads(model), eagle_layer(model)
    meta = torch.device("meta")
    model, heads, eagle = model.to(meta), heads.to(meta), eagle.to(meta)
    hidden = torch.empty(model.config.hidden_size, device=meta)
    root = torch.empty((), dtype=torch.long, device=meta)
    history = [1, 2, 3, 4]  # nothing to copy: the lookups find no continuation (a lone root's tree)
    problems = {
        name: meta_problems(model, make, hidden, root, history)
        for name, make in meta_drafters(model, heads, eagle).items()
    }
    assert {name: p for name, p in problems.items() if p} == {}


# -- whole replies on a virtual GPU ---------------------------------------------------------------


class ByteTokenizer:
    """Characters as token ids (modulo the vocabulary): enough for prompts with repeats."""

    pad_token_id = None
    chat_template = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i % 90) for i in ids)


@pytest.fixture(scope="module")
def virtual_parts():
    model = tiny_model("llama", vocab=VOCAB).to(torch.bfloat16)  # bf16: the dtype the CPU library takes
    heads = random_heads(model).to(torch.bfloat16)
    return model, heads, eagle_layer(model), every_pair()


def virtual_engine(model, heads, eagle, past: Corpus):
    from app.engine import Engine, Loaded
    from models.loader import Backbone

    engine = Engine("tiny")  # no replies added to the past ones: every test drafts from the same
    backbone = Backbone("tiny", model, ByteTokenizer(), ())
    costs = SimpleNamespace(curve=lambda: None, needed=False, rates=lambda kind: None)  # the policy's prior curve
    draft = draft_model(model.dtype, virtual_gpu=True)
    engine.loaded = Loaded(backbone, heads, True, "cpu-8", costs, past, eagle, draft)
    return engine


SETTINGS = {
    "greedy": DecodeSettings(max_new_tokens=40),
    "sampling": DecodeSettings(temperature=1.0, top_p=0.9, max_new_tokens=40),
    "typical": DecodeSettings(acceptance="typical", temperature=0.7, max_new_tokens=40),
}
PROMPT = "the cat sat on the mat; the cat sat on the mat; the cat sat on the"


@pytest.mark.parametrize("tree", [AUTO, "cpu-8"])
@pytest.mark.parametrize("rule", list(SETTINGS))
@pytest.mark.parametrize("kind", [*DRAFTERS, "plain"])
def test_whole_replies_stay_on_the_model_device_virtual_gpu(virtual_parts, monkeypatch, kind, rule, tree):
    from app.engine import ReplyRequest
    from core.decode.generate import Finished

    if kind == "plain" and tree != AUTO:
        pytest.skip("plain decoding has no tree")
    syncs = []
    monkeypatch.setattr(torch, "Generator", VirtualGenerator)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    model, heads, eagle, past = virtual_parts
    model, heads, eagle = place(model), place(heads), place(eagle)
    engine = virtual_engine(model, heads, eagle, past)
    mode = VirtualCuda()
    request = ReplyRequest(
        [{"role": "user", "content": PROMPT}], SETTINGS[rule], mode="baseline" if kind == "plain" else "medusa",
        tree=tree, drafter="" if kind == "plain" else kind, seed=0,
    )  # fmt: skip
    try:
        with mode:
            assert model.device == GPU
            mode.enter_in(engine.compute.call)
            try:
                events = list(engine.reply(request).events)
            finally:
                mode.leave_in(engine.compute.call)
    finally:
        engine.close()
    done = events[-1]
    assert isinstance(done, Finished) and len(done.token_ids) == 40 and mode.ops > 1000
    if kind != "plain" and (tree != AUTO or kind != "medusa"):  # the policy may find random heads not worth it
        assert any(e.tree_size > 1 for e in events[1:-1]), "no step drafted anything"
    if kind == "eagle" and tree != AUTO:  # a fixed budget: the EAGLE layer's nodes every step
        assert all("eagle" in e.node_sources for e in events[1:-1])
    assert syncs, "the step timing never synchronized with the GPU"


def test_the_virtual_gpu_refuses_what_a_gpu_refuses(monkeypatch):
    monkeypatch.setattr(torch, "Generator", VirtualGenerator)
    with VirtualCuda():
        gpu = torch.ones(3, device="cuda")
        assert gpu.device == GPU and torch.ones(3).device.type == "cpu"
        assert (gpu + torch.tensor(2.0)).device == GPU  # a CPU scalar is fine
        assert gpu[torch.tensor([0, 2])].device == GPU  # so are CPU indices
        gpu[0:2] = torch.zeros(2)  # and copies from the CPU
        assert gpu.cpu().device.type == "cpu" and gpu.device == GPU
        with pytest.raises(DeviceMixed):
            gpu + torch.ones(3)
        with pytest.raises(DeviceMixed):
            torch.cat([gpu, torch.ones(1)])
        with pytest.raises(DeviceMixed):
            gpu.data_ptr()
        with pytest.raises(DeviceMixed):
            torch.multinomial(gpu, 1, generator=torch.Generator())
        assert torch.multinomial(gpu, 1, generator=torch.Generator(gpu.device)).device == GPU
        layer = place(torch.nn.Linear(3, 2))
        assert layer(gpu).device == GPU
        with pytest.raises(DeviceMixed):
            layer(torch.ones(3))


def test_the_profile_the_cost_curve_and_the_bench_run_and_time_on_a_virtual_gpu(virtual_parts, monkeypatch):
    from app.bench import run_bench
    from core.drafters.fixed import MedusaDrafter
    from core.measure import costs, profile

    syncs = []
    monkeypatch.setattr(torch, "Generator", VirtualGenerator)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    model, heads, *_ = virtual_parts
    model, heads = place(model), place(heads)
    context = [(7 * i) % VOCAB for i in range(1, 41)]
    with VirtualCuda():
        drafter = make_drafter("hybrid", heads, load_preset("cpu-8").tree.to(GPU))
        backend = TorchBackend(model)
        steps = profile.step_costs(
            backend, context, lambda tree: MedusaDrafter(heads, tree), sizes=(1, 2, 8), repeats=1
        )
        profiled = len(syncs)
        curve = list(costs.measure(backend, heads, repeats=1, budget_s=0.0))[-1]
        measured = len(syncs)
        runs = run_bench(
            [context[:12]], ("hybrid", "baseline"), backend, DecodeSettings(max_new_tokens=8), {"hybrid": drafter}, ()
        )
    assert [s.nodes for s in steps] == [1, 2, 8] and curve.step_ms and len(runs) == 2
    assert 0 < profiled < measured < len(syncs)  # each of them waited for the GPU around what it timed
