"""Models loaded in int4 straight into the lean backend's packed layers (`models.direct`), a tensor
at a time from a GGUF file or a safetensors folder: a GGUF file's 4-bit blocks as it holds them,
everything else the same model, bit for bit, as the former path (a GGUF file converted to float32,
`from_pretrained`, then `lean.accelerate`); greedy tree decoding as plain decoding; and never the
whole model in full precision in memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from models import direct
from tests.gguf_writer import random_config, write_gguf
from tests.helpers import require_kernel, unpacked

PROMPT = "The cat sat on the mat, and then"
# a tiny Llama whose inputs are a multiple of 256, so the K types fit (they quantize 256 at a time)
TINY = dict(
    model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, tie_word_embeddings=False,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# one file, many types: the 4-bit mix, and layers of each type the `gguf` package reads or H2's writer makes
TYPES = {"blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "F16", "blk.0.attn_v.weight": "Q4_1",
         "blk.0.ffn_up.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K", "blk.1.attn_output.weight": "F32",
         "output.weight": "Q8_0"}  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A user cache of this module's own (descriptions, conversions, kernel choices)."""
    root = tmp_path_factory.mktemp("direct-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def mixed(cache, tmp_path_factory) -> Path:
    """A tiny random Llama GGUF file in Q4_0 with tensors of six other types."""
    file = tmp_path_factory.mktemp("direct-files") / "mixed.gguf"
    torch.manual_seed(0)
    config = random_config(TINY)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() > 1 else p.uniform_(0.5, 1.5)  # norms not all 1
    written = write_gguf(file, config, model.state_dict().items(), "Q4_0", override=TYPES)
    assert {written[name] for name in TYPES} == set(TYPES.values())
    return file


def old_path(monkeypatch) -> None:
    """Loading as before `models.direct`: from_pretrained (a GGUF file converted first), then packed."""
    monkeypatch.setattr(direct, "packed_model", lambda *args, **kwargs: None)


def logits(backbone) -> torch.Tensor:
    """The prompt's logits at every position, through the backend."""
    ids = torch.tensor(backbone.tokenizer(PROMPT)["input_ids"])
    backend = backbone.backend
    with torch.inference_mode():
        hidden, _ = backend.prefill(backend.new_cache(), ids)
        return backend.logits(hidden).full()


def greedy(backbone, steps: int = 12) -> list[int]:
    """Plain greedy decoding through the backend, a token at a time."""
    backend = backbone.backend
    ids = torch.tensor(backbone.tokenizer(PROMPT)["input_ids"])
    cache, out = backend.new_cache(), []
    with torch.inference_mode():
        hidden, _ = backend.prefill(cache, ids)
        for _ in range(steps):
            out.append(int(backend.logits(hidden[-1:])[0].argmax()))
            position = torch.tensor([backend.length(cache)])
            hidden, _ = backend.run(torch.tensor(out[-1:]), position, None, cache)
    return out


def packed_state(model) -> dict[str, torch.Tensor]:
    """Every tensor the model computes with: parameters, and the packed layers' weights."""
    state = {name: p.detach() for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        packed = getattr(module, "packed", None)
        for key in ("w", "d", "m"):
            if hasattr(packed, key):
                state[f"{name}.packed.{key}"] = getattr(packed, key)
        if isinstance(packed, torch.Tensor):
            state[f"{name}.packed"] = packed.to_dense() if packed.is_mkldnn else packed  # oneDNN's layout
        if isinstance(getattr(module, "scales_zeros", None), torch.Tensor):
            state[f"{name}.scales_zeros"] = module.scales_zeros
    return state


def assert_same_model(new, old) -> None:
    mine, theirs = packed_state(new.model), packed_state(old.model)
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    assert new.eos_ids == old.eos_ids and new.tokenizer.get_vocab() == old.tokenizer.get_vocab()


@pytest.fixture
def library_layers(monkeypatch):
    """The kernel library's 4-bit layers and 8-bit lm_head, whatever this machine measures fastest
    for so tiny a model (torch's int4 layers quantize again what they are given: CI's machine once
    measured them faster); skipped where there is no library."""
    from core.backends import q4
    from core.measure.kernels import Choice
    from models import loader

    if q4.library() is None:
        pytest.skip(f"no kernel library here: {q4.unavailable()}")
    monkeypatch.setattr(loader, "cpu_choice", lambda *args: Choice("bfloat16", "q4", "q8"))


def test_a_gguf_file_of_many_types_loads_its_4bit_blocks_as_they_are_and_the_rest_as_the_conversion(
    mixed, monkeypatch, capsys, library_layers
):
    """Q4_0, Q4_1 and Q4_K weights go into the 4-bit layers as the file's blocks (its values:
    exactly, Q4_K's steps to float16 where its layer holds other parts per group); every other
    tensor is what the former path (the file converted, `from_pretrained`, packed) gives, bit for
    bit where it holds it in the same form."""
    from models.loader import load_backbone

    require_kernel("int4", torch.bfloat16)
    monkeypatch.setattr(direct, "CHUNK", 1 << 16)  # the embedding and output read in parts of 64 rows
    new = load_backbone(str(mixed), device="cpu", quantization="int4")
    said = capsys.readouterr().err
    assert "Converting" not in said and not (new.folder / "model.safetensors").exists()
    (note,) = [line for line in said.splitlines() if line.startswith("note:")]  # one line on what is requantized
    assert all(kind in note for kind in ("F16", "F32", "Q6_K", "Q8_0"))
    assert not any(kind in note for kind in ("Q4_0", "Q4_1", "Q4_K"))
    old_path(monkeypatch)
    old = load_backbone(str(mixed), device="cpu", quantization="int4")
    assert "Converting" in capsys.readouterr().err
    exact = load_file(old.folder / "model.safetensors")  # the conversion: the file's weights in float32
    mine, theirs = packed_state(new.model), packed_state(old.model)
    assert mine.keys() == theirs.keys()
    taken = 0
    for name, module in new.model.named_modules(remove_duplicate=False):
        if getattr(module, "kernel", None) != "q4" or name.endswith(".fused"):  # a fused layer by its own name
            continue
        got, before = unpacked(module.packed), unpacked(old.model.get_submodule(name).packed)
        for part, rows in parts_of(new.model, name, module):
            kind = TYPES.get(gguf_name(f"{part}.weight"), "Q4_0")
            want = exact[f"{part}.weight"]
            if kind in ("Q4_0", "Q4_1"):
                assert torch.equal(got[rows], want), part
            elif kind == "Q4_K":
                assert (got[rows] - want).abs().max() < 1e-3 * want.abs().max(), part
            elif bool(module.packed.k6.numel()) == bool(old.model.get_submodule(name).packed.k6.numel()):
                assert torch.equal(got[rows], before[rows]), part  # quantized again, as before
            else:  # quantized again in another form (the layer's other parts held per group here)
                assert (got[rows] - want).pow(2).mean() < 1.1 * (before[rows] - want).pow(2).mean(), part
            taken += kind.startswith("Q4_")
    assert taken >= 8
    mine, theirs = ({k: t for k, t in state.items() if not in_4bit_layer(model, t)} for state, model in
                    ((mine, new.model), (theirs, old.model)))  # fmt: skip
    assert mine.keys() == theirs.keys() and len(mine) >= 8  # embedding, norms, the lm_head
    for name, tensor in mine.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    assert len(greedy(new)) == 12


def in_4bit_layer(model, tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a 4-bit library layer's packed weight, steps or minimums."""
    held = (m.packed for m in model.modules() if getattr(m, "kernel", None) == "q4")
    return any(tensor is t for p in held for t in (p.w, p.d, p.m, p.k6))


def parts_of(model, name: str, module) -> list[tuple[str, slice]]:
    """The projections the packed layer `name` holds and their rows in it (q, k, v; gate, up; or
    itself)."""
    from core.backends.lean.surgery import Part

    owner = name.rpartition(".")[0]
    parts = model.get_submodule(owner).named_children()
    held = [(f"{owner}.{n}", slice(m.start, m.stop)) for n, m in parts if isinstance(m, Part) and m.fused is module]
    return held or [(name, slice(None))]


def gguf_name(name: str) -> str:
    """The GGUF name of a transformers weight of TINY's model."""
    from tests.gguf_writer import gguf_name as named

    return named(name, TINY["num_hidden_layers"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_safetensors_folder_loads_into_the_model_from_pretrained_gives(cache, tmp_path, monkeypatch, dtype):
    from core.backends import lean
    from models.loader import load_backbone
    from tests.gguf_writer import random_folder

    require_kernel("int4", torch.bfloat16)
    shape = dict(TINY, tie_word_embeddings=True)
    folder = random_folder(shape, tmp_path / "tiny") if dtype == torch.bfloat16 else _float32_folder(shape, tmp_path)
    monkeypatch.setattr(direct, "CHUNK", 1 << 16)  # a float32 file's tensors cast in parts
    reads = []
    monkeypatch.setattr(direct.SafetensorsFolder, "read", _counting(direct.SafetensorsFolder.read, reads))
    new = load_backbone(str(folder), device="cpu", quantization="int4")
    assert reads  # read by the direct path
    old_path(monkeypatch)
    old = load_backbone(str(folder), device="cpu", quantization="int4")
    assert_same_model(new, old)
    head, embedding = new.model.get_output_embeddings(), new.model.get_input_embeddings()
    if isinstance(head, lean.TiedHead):  # an 8-bit lm_head: the embedding reads its packed rows
        assert embedding._head[0] is head
    else:
        assert head.weight is embedding.weight
    assert torch.equal(logits(new), logits(old))


def test_the_librarys_kernels_pack_weights_as_read_and_hold_a_tied_vocabulary_once(
    cache, tmp_path, monkeypatch, library_layers
):
    """With the library's kernels (4-bit layers, the 8-bit lm_head), each layer weight is packed
    into its rows of the fused weight as it is read, and a tied vocabulary becomes one packed
    table that the lm_head multiplies and the embedding reads rows of: the same packed bytes and
    logits as packing the whole model after `from_pretrained`, and no dense (V, H) table kept."""
    from core.backends import lean
    from models import loader
    from tests.gguf_writer import random_folder

    folder = random_folder(dict(TINY, tie_word_embeddings=True), tmp_path / "tied")
    taken = []
    monkeypatch.setattr(lean.PackAsRead, "take", _counting_take(lean.PackAsRead.take, taken))
    new = loader.load_backbone(str(folder), device="cpu", quantization="int4")
    assert sum(taken) == 2 * 7  # every linear weight of both layers packed as read
    head, embedding = new.model.get_output_embeddings(), new.model.get_input_embeddings()
    assert isinstance(head, lean.TiedHead) and embedding._head[0] is head
    tables = [t for t in packed_state(new.model).values() if t.shape == (TINY["vocab_size"], TINY["hidden_size"])]
    assert not tables
    ids = torch.tensor([[5, 49151, 7]])
    assert torch.equal(embedding(ids), lean.eight_bit_rows(head.packed, ids.flatten(), torch.bfloat16).view(1, 3, -1))
    old_path(monkeypatch)
    old = loader.load_backbone(str(folder), device="cpu", quantization="int4")
    assert_same_model(new, old)
    assert torch.equal(logits(new), logits(old)) and greedy(new) == greedy(old)


def _counting_take(take, calls: list):
    def counted(self, name, weight):
        calls.append(took := take(self, name, weight))
        return took

    return counted


def _float32_folder(shape: dict, tmp_path: Path) -> Path:
    from tests.gguf_writer import random_folder

    folder = random_folder(shape, tmp_path / "tiny32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # values bf16 cannot hold: the cast is exercised
    model.save_pretrained(folder)
    return folder


def _counting(read, calls: list):
    def counted(self, name, dtype):
        calls.append(name)
        return read(self, name, dtype)

    return counted


def test_tree_decoding_of_a_directly_loaded_gguf_file_equals_plain_decoding(mixed, capsys):
    from tests.test_gguf_files import generate

    require_kernel("int4", torch.bfloat16)
    tree, said = generate(capsys, str(mixed))
    assert "(4-bit int4)" in said and "Converting" not in said
    assert tree == generate(capsys, str(mixed), "--mode", "baseline")[0] and len(tree) > 0


@pytest.mark.embedded
def test_the_embedded_file_by_path_is_the_model_its_conversion_gives(monkeypatch, capsys):
    from models.embedded import EMBEDDED_ID, embedded_dir, embedded_gguf
    from models.loader import load_backbone
    from tests.test_gguf_files import generate

    new = load_backbone(str(embedded_gguf()), device="cpu")
    plain, said = generate(capsys, str(embedded_gguf()), "--mode", "baseline")
    assert "Converting" not in said and "note:" not in said  # Q4_1 layers: nothing requantized to say
    assert generate(capsys, str(embedded_gguf()))[0] == plain  # the tree
    assert generate(capsys, EMBEDDED_ID, "--mode", "baseline")[0] == plain
    folder = embedded_dir()  # the conversion, loaded as before
    old_path(monkeypatch)
    old = load_backbone(str(folder), device="cpu")
    assert_same_model(new, old)
    assert torch.equal(logits(new), logits(old))
    assert generate(capsys, str(folder), "--mode", "baseline")[0] == plain


# ---- memory: never the whole model in full precision ----

MEASURE = """
import json, sys
from pathlib import Path
from core.measure.kernels import Choice
from models import direct, loader
kernels = ("int4", "int4") if sys.argv[3] == "int4" else ("q4", "q8")  # the same kernels on every machine
loader.cpu_choice = lambda *args: Choice("bfloat16", *kernels)
loader.kernels.head_by_row = lambda *args: False  # and no lm_head timing
if sys.argv[2] == "old":
    direct.packed_model = lambda *args, **kwargs: None
def kb(key):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
spec = loader.resolve(sys.argv[1])
loader.q4.library()  # built or loaded before the baseline
before = kb("VmRSS:")
backbone = loader.load_backbone(sys.argv[1], spec=spec, device="cpu", quantization="int4")
print(json.dumps({"before": before * 1024, "peak": kb("VmHWM:") * 1024}))
"""
MEDIUM = dict(TINY, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, tie_word_embeddings=True)  # fmt: skip  # ~140M parameters


def peak_growth(file: Path, how: str, kernels: str = "int4") -> int:
    """Bytes the process's peak memory grows by while `file` loads (in a fresh process), with
    torch's int4 kernels ("int4") or the library's ("library": 4-bit layers, 8-bit lm_head)."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(file), how, kernels],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return measured["peak"] - measured["before"]


@pytest.fixture(scope="module")
def medium(cache, tmp_path_factory) -> Path:
    """A ~150 MB Q8_0 file (about 560 MB in float32), described already (its tokenizer written)."""
    from models.loader import resolve

    file = tmp_path_factory.mktemp("direct-medium") / "medium.Q8_0.gguf"
    config = random_config(MEDIUM)
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(config).state_dict()
    gen = np.random.default_rng(0)
    tensors = (
        (name, torch.from_numpy(gen.standard_normal(t.shape, dtype=np.float32) * 0.02 + (t.dim() == 1)))
        for name, t in shapes.items()
    )
    write_gguf(file, config, tensors, "Q8_0")
    resolve(str(file))
    return file


def test_loading_a_gguf_file_never_holds_the_model_in_full_precision(medium):
    from models.direct_gguf import tensor_table

    require_kernel("int4", torch.bfloat16)
    if not Path("/proc/self/status").is_file():
        pytest.skip("reads the process's memory from /proc (Linux)")
    float32 = 4 * sum(int(np.prod(gguf_shape(e))) for e in tensor_table(medium)[1].values())
    growth = peak_growth(medium, "new")
    # what stays (4-bit layers, a bf16 embedding, a 4-bit output copy, the tokenizer) and one
    # layer at a time: about a quarter of the float32 model, which the former path held (and more)
    assert growth < 0.6 * float32, f"{growth / 1e6:.0f} MB at the peak; the model is {float32 / 1e6:.0f} MB in float32"


def gguf_shape(entry) -> tuple[int, ...]:
    import gguf

    plain = entry.kind.name in ("F32", "F16")
    return entry.shape if plain else gguf.quant_shape_from_byte_shape(entry.shape, entry.kind)


def test_with_the_librarys_kernels_a_load_grows_the_process_by_about_the_files_size(medium):
    """The library's kernels (this file's Q8_0 layers run at 8 bits, its tied Q8_0 vocabulary
    packed as it is, once): the load's peak is what stays (~1.12x the file: a step per 32 and the
    activations' sums) and one weight in flight, not a layer or a dense vocabulary table. The
    issue's bound (1.3x the file + 300 MB, whole process) leaves 300 MB for the process itself:
    torch and transformers alone take ~360 MB here, so the growth is what is tested."""
    from core.backends import q4

    if q4.library() is None:
        pytest.skip(f"no kernel library here: {q4.unavailable()}")
    if not Path("/proc/self/status").is_file():
        pytest.skip("reads the process's memory from /proc (Linux)")
    size = medium.stat().st_size
    growth = peak_growth(medium, "new", "library")
    assert growth < 1.3 * size + 64e6, f"{growth / 1e6:.0f} MB at the peak for a {size / 1e6:.0f} MB file"
