"""The GPU path on a real GPU (skipped without one): every drafter through the engine, bf16 and
nf4 against plain decoding up to rounding, lossless sampling's distribution, and --device routing.

Where a configuration is exact only up to rounding (`core.decode.precision`), a tree reply must equal
the plain one, or differ first where the plain model's two candidates are within rounding of
each other: a near tie, not a wrong token.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from app.bench import first_difference
from core.backends.torch import TorchBackend
from core.decode import precision
from core.decode.generate import Finished
from core.decode.settings import DecodeSettings
from core.decode.tree import AUTO
from core.drafters.draft_model import DraftModel
from core.drafters.eagle import EagleDraft, init_from_backbone
from core.drafters.registry import DRAFTERS
from models.heads import MedusaHeads
from tests.test_devices import every_pair
from tests.tiny_folder import save_tiny_model

pytestmark = pytest.mark.cuda
PROMPT = "the cat sat on the mat; the cat sat on the mat; the cat sat on the"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-cuda"))


@pytest.fixture(scope="module")
def past():
    return every_pair()


def engine_for(spec, past, device: str = "cuda", dtype: str = "bfloat16", quantization: str = "none"):
    """The engine the chat and the API use, with the tiny model on `device`, random heads, an
    EAGLE layer and past replies to copy from."""
    from types import SimpleNamespace

    from app.engine import Engine, Loaded
    from models.loader import load_backbone

    backbone = load_backbone(spec.name, dtype=dtype, device=device, quantization=quantization, spec=spec)
    model = backbone.model
    torch.manual_seed(0)
    lm_head = model.get_output_embeddings()
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, 4, 1, lm_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    heads = heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype).eval()
    eagle = EagleDraft(model, torch.arange(model.config.vocab_size))
    if backbone.backend.layer_kernel is None and precision.quantization(model) is None:  # transformers' layers
        init_from_backbone(eagle, model)  # the layer starts as the backbone's last
    eagle = eagle.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype).eval()
    engine = Engine(spec.name)
    costs = SimpleNamespace(curve=lambda: None, needed=False, rates=lambda kind: None)
    draft = DraftModel(spec.name, backbone.backend, model.config.vocab_size)  # the model drafting for itself
    engine.loaded = Loaded(backbone, heads, True, "cpu-8", costs, past, eagle, draft)
    return engine


def reply(engine, kind: str, settings: DecodeSettings, tree: str = AUTO) -> tuple[list, Finished]:
    from app.engine import ReplyRequest

    plain = kind == "plain"
    request = ReplyRequest(
        [{"role": "user", "content": PROMPT}], settings, mode="baseline" if plain else "medusa", tree=tree,
        drafter="" if plain else kind, seed=0,
    )  # fmt: skip
    events = list(engine.reply(request).events)
    return events[:-1], events[-1]


def agrees_up_to_rounding(engine, tree: tuple[int, ...], plain: tuple[int, ...], exact: bool) -> bool:
    """`tree` equals `plain`, or (where the configuration rounds) differs first at a near tie of
    the plain model's logits."""
    if tree == plain:
        return True
    i = first_difference(tree, plain)
    if exact or i >= min(len(tree), len(plain)):
        return False
    backbone = engine.loaded.backbone
    prompt = backbone.encode_chat(PROMPT)
    with torch.inference_mode():
        ids = torch.tensor([prompt + list(plain[:i])], device=backbone.model.device)
        logits = backbone.model(ids).logits[0, -1].float()
    margin = 0.05 * float(logits.abs().max()) + 1e-3
    return float(logits[plain[i]] - logits[tree[i]]) <= margin


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_drafter_replies_through_the_engine_on_cuda(tiny, past, dtype):
    engine = engine_for(tiny, past, dtype=dtype)
    try:
        assert "on cuda" in engine.status()
        for rule in (DecodeSettings(max_new_tokens=48), DecodeSettings(temperature=1.0, max_new_tokens=48)):
            _, plain = reply(engine, "plain", rule)
            for kind in DRAFTERS:
                for tree in (AUTO, "cpu-8"):
                    steps, done = reply(engine, kind, rule, tree)
                    assert done.finish_reason in ("length", "eos") and len(done.token_ids) == sum(
                        map(len, (e.token_ids for e in steps))
                    )
                    if tree != AUTO:  # (the policy may judge random heads not worth drafting with)
                        assert any(e.tree_size > 1 for e in steps[1:]), f"{kind} on {tree} never drafted"
                    if (
                        rule.temperature == 0
                    ):  # lossless sampling draws alike for a seed too, but a near tie is not defined
                        exact = done.exactness == "exact"
                        assert agrees_up_to_rounding(engine, done.token_ids, plain.token_ids, exact), (kind, tree)
    finally:
        engine.close()


def test_nf4_tree_decoding_equals_plain_up_to_rounding_on_cuda(tiny, past):
    engine = engine_for(tiny, past, dtype="auto", quantization="nf4")
    try:
        model = engine.loaded.backbone.model
        assert type(model.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
        assert "lossless is exact up to bfloat16 rounding" in engine.status()
        _, plain = reply(engine, "plain", DecodeSettings(max_new_tokens=64))
        for kind in ("medusa", "hybrid", "eagle"):
            _, done = reply(engine, kind, DecodeSettings(max_new_tokens=64), "cpu-8")
            assert done.exactness == "exact up to bfloat16 rounding"
            assert agrees_up_to_rounding(engine, done.token_ids, plain.token_ids, exact=False), kind
    finally:
        engine.close()


def test_lossless_sampling_keeps_the_distribution_on_cuda():
    """Three-token replies sampled with each drafter against the model's exact distribution."""
    from core.decode.generate import collect, stream
    from core.decode.tree import build_tree
    from core.drafters.build import make_drafter
    from core.drafters.eagle_tree import eagle_drafter
    from core.drafters.fixed import MedusaDrafter
    from tests.helpers import exact_three_tokens, tiny_model
    from tests.stats import chi_square_p_value

    vocab, prompt, n = 6, [1, 4, 2], 3000  # a small vocabulary: every reply a cell of the test
    exact = exact_three_tokens(tiny_model("llama", vocab=vocab, seed=2), prompt, vocab)  # on the CPU
    model = tiny_model("llama", vocab=vocab, seed=2).to("cuda")
    torch.manual_seed(5)
    heads = MedusaHeads(model.config.hidden_size, vocab, 2, 1, model.lm_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    eagle = EagleDraft(model, torch.arange(vocab))
    init_from_backbone(eagle, model)
    tree = build_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0]]).to("cuda")
    drafters = {
        "medusa": MedusaDrafter(heads.to("cuda").eval(), tree),
        "lookup": make_drafter("lookup", None, tree),
        "eagle": eagle_drafter(eagle.to("cuda").eval(), budget=5),
    }
    settings = DecodeSettings(temperature=1.0, max_new_tokens=3)
    for kind, drafter in drafters.items():
        generator = torch.Generator("cuda").manual_seed(11)
        backend = TorchBackend(model)
        replies = (collect(stream(backend, prompt, settings, drafter, generator=generator))[1] for _ in range(n))
        counts = Counter(done.token_ids for done in replies)
        assert chi_square_p_value(counts, exact, n) > 1e-3, kind


def test_quantized_loads_go_to_the_named_gpu(tiny):
    from models.loader import load_backbone

    last = f"cuda:{torch.cuda.device_count() - 1}"  # cuda:1 where there are two
    backbone = load_backbone(tiny.name, device=last, quantization="nf4", spec=tiny)
    assert {str(p.device) for p in backbone.model.parameters()} == {last}
    on_cpu = load_backbone(tiny.name, device="cpu", quantization="nf4", spec=tiny)
    assert {p.device.type for p in on_cpu.model.parameters()} == {"cpu"}


def test_the_clock_waits_for_the_gpu():
    from core.measure.clock import now

    x = torch.randn(2048, 2048, device="cuda")
    start = now("cuda")
    for _ in range(8):
        x = x @ x / 2048
    assert now("cuda") >= start and torch.isfinite(x).all()
