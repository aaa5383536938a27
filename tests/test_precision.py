"""What a reply promises against plain decoding, per configuration, and where it is said; and the
cache passed to transformers the way the installed release documents (no deprecation warning)."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from core.backends import lean as fast
from core.backends.torch import TorchBackend
from core.decode import precision
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import load_preset
from core.drafters.build import make_drafter
from core.drafters.eagle import EagleDraft, init_from_backbone
from core.drafters.eagle_tree import eagle_drafter
from core.drafters.fixed import MedusaDrafter
from models.heads import MedusaHeads
from tests.helpers import library_builds, tiny_backend, tiny_model
from tests.tiny_folder import save_tiny_model

ROUNDING = "exact up to {} rounding"
PROMPT = [3, 17, 33, 5, 60, 17, 33, 5, 41]


def heads_for(model, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, 4, 1, model.lm_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return heads.to(model.dtype).eval()


@pytest.fixture(scope="module")
def nf4_model(tmp_path_factory):
    """The tiny model in 4-bit nf4 on the CPU, float32 asked for (bitsandbytes computes in bf16)."""
    from models.loader import load_backbone

    spec = save_tiny_model(tmp_path_factory.mktemp("tiny-nf4"))
    return load_backbone(spec.name, dtype="float32", device="cpu", quantization="nf4", spec=spec)


def test_exactness_per_precision(nf4_model):
    fp32 = tiny_backend("llama")
    assert precision.exactness(fp32) == precision.EXACT
    assert precision.exactness(fp32, DecodeSettings(acceptance="typical", temperature=0.5)) == precision.TYPICAL
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        assert precision.exactness(TorchBackend(tiny_model("llama").to(dtype))) == ROUNDING.format(name)
    # float32 asked for with nf4: the layers compute in bf16, and the note says so
    assert nf4_model.model.dtype == torch.float32 and precision.quantization(nf4_model.model) == "nf4"
    assert precision.exactness(nf4_model.backend) == ROUNDING.format("bfloat16")
    on_gpu = SimpleNamespace(dtype=torch.float32, device=torch.device("cuda", 0), config=SimpleNamespace())
    assert precision.exactness(TorchBackend(on_gpu)) == ROUNDING.format("float32")  # cuBLAS picks kernels by shape
    assert precision.exactness(TorchBackend(tiny_model("llama").to(torch.bfloat16)), tree=False) == precision.EXACT


def test_the_library_decoder_is_exact_in_bf16():
    if not (fast.kernel_works("q4", torch.bfloat16) or library_builds()):
        pytest.skip("the kernel library does not run here")
    assert precision.exactness(tiny_backend("llama+q4")) == precision.EXACT


def test_replies_say_what_they_promise(nf4_model):
    model, backend = nf4_model.model, nf4_model.backend
    drafter = MedusaDrafter(heads_for(model), load_preset("cpu-8").tree)
    _, tree = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=12), drafter))
    _, plain = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=12)))
    assert tree.exactness == ROUNDING.format("bfloat16") and plain.exactness == precision.EXACT
    fp32 = tiny_backend("llama")
    heads = heads_for(fp32.model)
    _, exact = collect(
        stream(fp32, PROMPT, DecodeSettings(max_new_tokens=6), MedusaDrafter(heads, load_preset("cpu-8").tree))
    )
    assert exact.exactness == precision.EXACT


def test_the_chat_and_the_api_show_the_note(nf4_model):
    from app.engine import Engine, Loaded, figures

    engine = Engine("tiny")
    try:
        engine.loaded = Loaded(nf4_model, None, True, "cpu-8", None)
        status = engine.status()
        assert "nf4 weights, bfloat16 on cpu" in status and "lossless is exact up to bfloat16 rounding" in status
        plain = tiny_backend("llama")
        engine.loaded = Loaded(SimpleNamespace(model=plain.model, backend=plain), None, True, "cpu-8", None)
        assert "exact up to" not in engine.status()
    finally:
        engine.close()
    _, done = collect(
        stream(
            nf4_model.backend,
            PROMPT,
            DecodeSettings(max_new_tokens=4),
            make_drafter("lookup", None, load_preset("cpu-8").tree),
        )
    )
    assert figures(done)["exactness"] == ROUNDING.format("bfloat16")  # the chat's stats and the API's `medusa` field


def test_bench_reports_the_agreement_in_its_precision(nf4_model):
    from app.bench import agreement, precision_label, run_bench, summarize

    model = nf4_model.model
    drafters = {"medusa": MedusaDrafter(heads_for(model), load_preset("cpu-8").tree)}
    runs = run_bench(
        [PROMPT, PROMPT[:5]], ("medusa", "baseline"), nf4_model.backend, DecodeSettings(max_new_tokens=8), drafters, ()
    )
    summary = summarize(runs)
    label = precision_label(model)
    assert label == "nf4 weights, bfloat16 compute"
    line = agreement(summary, 2, label)
    assert line == f"agreement with the plain loop in {label}: medusa {summary['medusa'].exact}/2"
    alone = summarize([r for r in runs if r.mode == "medusa"])
    assert agreement(alone, 2, label).endswith("no plain loop ran")


# -- no deprecation warning from transformers in the decode paths ---------------------------------


@contextmanager
def no_transformers_deprecations():
    """Fail on a FutureWarning or DeprecationWarning about transformers' API, and on its logger's
    deprecation notes (given once per process: the memory of which were given is cleared)."""
    notes: list[str] = []

    class Notes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            notes.append(record.getMessage())

    root = logging.getLogger("transformers")
    handler = Notes(logging.WARNING)
    root.addHandler(handler)
    if hasattr(logging.Logger, "warning_once"):
        logging.Logger.warning_once.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        root.removeHandler(handler)
    ours = [str(w.message) for w in caught if _deprecation(w)]
    assert ours == [] and [n for n in notes if "deprecat" in n.lower()] == []


def _deprecation(w: warnings.WarningMessage) -> bool:
    """A FutureWarning (transformers' deprecations), or a DeprecationWarning from or about transformers."""
    text = str(w.message)
    about = "transformers" in w.filename or ("deprecated" in text and "transformers" in text)
    return issubclass(w.category, FutureWarning) or (issubclass(w.category, DeprecationWarning) and about)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_decode_paths_raise_no_deprecation_warning(arch):
    backend = tiny_backend(arch)
    model = backend.model
    tree = load_preset("cpu-8").tree
    eagle = EagleDraft(model, torch.arange(model.config.vocab_size), taps=(1,))  # reads a tapped stream too
    init_from_backbone(eagle, model)
    drafters = [None, MedusaDrafter(heads_for(model), tree), make_drafter("hybrid", heads_for(model), tree)]
    drafters.append(eagle_drafter(eagle.eval(), budget=6))
    with no_transformers_deprecations():
        for drafter in drafters:
            for settings in (DecodeSettings(max_new_tokens=10), DecodeSettings(temperature=1.0, max_new_tokens=10)):
                collect(stream(backend, PROMPT, settings, drafter, generator=torch.Generator().manual_seed(0)))
        with torch.inference_mode():  # the draft layer's own forward (training and features) on a transformers cache
            ids = torch.tensor([PROMPT])
            features = torch.zeros(1, len(PROMPT), model.config.hidden_size)
            eagle(features, ids, torch.arange(len(PROMPT)).view(1, -1), None, DynamicCache())


def test_the_stock_peer_decodes_without_deprecation_warnings():
    from app.bench import run_once

    backend = tiny_backend("llama")
    with no_transformers_deprecations():
        for mode in ("hf", "hf-pld"):
            run_once(mode, backend, PROMPT, DecodeSettings(max_new_tokens=6), {}, (0,), 0)
