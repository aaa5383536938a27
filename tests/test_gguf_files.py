"""GGUF files given to --model: tiny Llamas written here with the `gguf` package (F32, F16 and
quantized tensors, a byte-level BPE tokenizer and a chat template in the metadata), described
(config and tokenizer) once into a folder keyed by the file's hash and, for full precision,
converted into it, decoded exactly; bad files refused with one sentence; and what
`--quantization auto` means on a CPU. (int4 loads read the file itself: tests/test_direct_load.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tests.helpers import require_kernel
from tests.tiny_folder import CHARS, save_tiny_model

HIDDEN, LAYERS, HEADS, KV_HEADS, INNER = 64, 2, 4, 2, 128
MERGES = ["t h", "h e"]  # two merges, so the file's BPE merges are seen to be applied
END = "<|end|>"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPT = "the cat sat on the mat"
TYPES = ("F32", "F16", "Q8_0", "Q4_0")  # the tensor types of the files decoded
# the Llama tensors as llama.cpp's converter names them
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def vocabulary() -> list[str]:
    """The 96 characters of tests/tiny_folder.py in the byte-level spelling (a space is Ġ), two
    merged pairs and an end token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[ord(c)] for c in CHARS] + ["th", "he", END]


def tensor_names() -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names["lm_head.weight"] = "output.weight"
    for i in range(LAYERS):
        names |= {f"model.layers.{i}.{ours}.weight": f"blk.{i}.{theirs}.weight" for ours, theirs in LAYER_NAMES.items()}
    return names


def _permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """q and k rows in llama.cpp's rotary order (its converter's `permute`)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    path: Path, tensor_type: str = "F32", seed: int = 0, architecture: str = "llama", tokenizer: bool = True
) -> LlamaForCausalLM:
    """A random tiny Llama as a GGUF file at `path`, as llama.cpp writes one; its matrices in
    `tensor_type` (F32, F16 or a type gguf.quants quantizes: Q8_0, Q4_0, Q4_1…). Returns the model."""
    import gguf

    vocab = vocabulary()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=HIDDEN, intermediate_size=INNER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        initializer_range=0.1, eos_token_id=len(vocab) - 1, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("tiny")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INNER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(len(vocab))
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(vocab)
        writer.add_token_types([gguf.TokenType.NORMAL] * (len(vocab) - 1) + [gguf.TokenType.CONTROL])
        writer.add_token_merges(MERGES)
        writer.add_eos_token_id(len(vocab) - 1)
        writer.add_add_bos_token(False)
        writer.add_chat_template(TEMPLATE)
    kind = gguf.GGMLQuantizationType[tensor_type]
    names = tensor_names()
    for name, tensor in model.state_dict().items():
        weight = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            weight = _permuted(weight, HEADS)
        elif name.endswith("k_proj.weight"):
            weight = _permuted(weight, KV_HEADS)
        if weight.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(names[name], weight)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(names[name], weight.astype(np.float16))
        else:
            blocks = gguf.quants.quantize(weight, kind)
            writer.add_tensor(names[name], blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A user cache of this module's own (conversions, the hash index, kernel choices, step costs)."""
    root = tmp_path_factory.mktemp("gguf-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def files(cache, tmp_path_factory):
    """Tiny GGUF files by tensor type, and the models they were written from."""
    root = tmp_path_factory.mktemp("gguf-files")
    return {kind: (root / f"tiny-{kind}.gguf", write_gguf(root / f"tiny-{kind}.gguf", kind)) for kind in TYPES}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`medusa-chat ARGS` run in this process: its exit status, stdout and stderr."""
    from app.main import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def generate(capsys, model: str, *args: str) -> tuple[list[int], str]:
    """The token ids `generate --json` replies with (greedy, 24 tokens), and what it said on stderr."""
    code, out, err = cli(capsys, "generate", "--json", "--model", model, "--prompt", PROMPT,
                         "--max-new-tokens", "24", "--temperature", "0", *args)  # fmt: skip
    assert code == 0, err
    (sample,) = json.loads(out)["samples"]
    return sample["token_ids"], err


def refused(code: int, out: str, err: str) -> str:
    """The one sentence of a refused command: exit 2, nothing on stdout, one line on stderr."""
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and err.startswith("error: "), (code, out, err)
    return err.strip().removeprefix("error: ")


# ---- conversion ----


def test_a_gguf_file_converts_to_the_model_it_was_written_from(files):
    from models.gguf_files import folder_for
    from models.loader import resolve

    file, source = files["F32"]
    spec = resolve(str(file))
    assert spec.name == str(file) and spec.tree == "cpu-16" and spec.heads_folder is None and spec.gguf == file
    assert spec.folder.parent.name == "models" and spec.folder.name.startswith("gguf-")
    assert folder_for(file) == spec.folder  # converted into the folder that describes it
    converted = AutoModelForCausalLM.from_pretrained(spec.folder, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 40, 96, 0, 97, 65, 84]])
    with torch.no_grad():
        assert torch.allclose(converted(ids).logits, source(ids).logits, atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(spec.folder)
    assert tokenizer("the")["input_ids"] == [96, CHARS.index("e")]  # the file's merge "t h" applied
    assert tokenizer.decode(tokenizer(PROMPT)["input_ids"]) == PROMPT
    assert tokenizer.eos_token == END and tokenizer.chat_template == TEMPLATE


@pytest.mark.parametrize("kind", TYPES)
def test_generate_with_a_gguf_file_replies_as_its_converted_folder_and_the_tree_as_the_plain_loop(
    files, capsys, monkeypatch, kind
):
    from core.measure.kernels import Choice
    from models import loader
    from models.gguf_files import folder_for

    # int4 on the library's kernels, whose layers take the file's blocks (where torch's int4 kernel
    # wins this tiny model's timed choice, as in one clean-clone CI, it quantizes Q4_0 again)
    measured = loader.cpu_choice
    monkeypatch.setattr(
        loader,
        "cpu_choice",
        lambda config, dtype, int4: Choice("bfloat16", "q4", "q8") if int4 else measured(config, dtype, int4),
    )
    file = str(files[kind][0])
    folder = str(folder_for(Path(file)))
    for precision in (("--dtype", "float32"), ()):  # full precision, and int4 (auto on a CPU)
        tree, said = generate(capsys, file, *precision)
        assert "Converting" not in said  # converted once, above (int4 reads the file itself)
        assert ("(4-bit int4)" in said) == (not precision) and f"Loading {file} (" in said
        if kind in ("Q8_0", "Q4_0") and not precision:  # the layers take the file's blocks (8-bit, 4-bit) as they are
            assert "run as" not in said  # nothing quantized again to tell of
        else:  # as the converted folder's layers run
            assert tree == generate(capsys, folder, *precision)[0]
        assert tree == generate(capsys, file, "--mode", "baseline", *precision)[0]
        assert len(tree) > 0


def test_a_second_load_neither_converts_nor_hashes_the_file_again(cache, tmp_path, monkeypatch, capsys):
    from models import gguf_files
    from models.loader import resolve

    calls = {"hash": 0, "convert": 0}
    hash_file, write_description = gguf_files.sha256_of, gguf_files._write_description

    def hashing(path):
        calls["hash"] += 1
        return hash_file(path)

    def describing(gguf, folder):
        calls["convert"] += 1
        return write_description(gguf, folder)

    monkeypatch.setattr(gguf_files, "sha256_of", hashing)
    monkeypatch.setattr(gguf_files, "_write_description", describing)
    file = tmp_path / "model.gguf"
    write_gguf(file, "Q8_0", seed=5)
    capsys.readouterr()
    first = resolve(str(file)).folder
    assert calls == {"hash": 1, "convert": 1}
    assert capsys.readouterr().err == f"Reading the tokenizer and config of {file} (once)…\n"  # one line, no bar
    assert resolve(str(file)).folder == first and calls == {"hash": 1, "convert": 1}
    assert capsys.readouterr().err == ""
    os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))  # touched: hashed again, same key
    assert resolve(str(file)).folder == first and calls == {"hash": 2, "convert": 1}
    copy = tmp_path / "copy.gguf"  # the same bytes elsewhere: the same conversion
    copy.write_bytes(file.read_bytes())
    assert resolve(str(copy)).folder == first and calls == {"hash": 3, "convert": 1}
    index = json.loads((cache / "medusa-chat" / "gguf-index.json").read_text())
    assert first.name == "gguf-" + index[str(file.resolve())]["sha256"][:16]


DAMAGES = ("truncated weights", "no weights", "no config", "garbled config")


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_conversion_is_rebuilt(cache, tmp_path, capsys, damage):
    from models.gguf_files import folder_for, is_converted

    file = tmp_path / "model.gguf"
    write_gguf(file, "F16", seed=7 + DAMAGES.index(damage))  # a file (and conversion) of its own
    folder = folder_for(file)
    weights = (folder / "model.safetensors").read_bytes()
    if damage == "truncated weights":
        (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    elif damage == "no weights":
        (folder / "model.safetensors").unlink()
    elif damage == "no config":
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_text("{ not json")
    assert not is_converted(folder)
    capsys.readouterr()
    assert folder_for(file) == folder and is_converted(folder)
    assert "Converting" in capsys.readouterr().err
    assert (folder / "model.safetensors").read_bytes() == weights


# ---- bad input: one sentence, exit 2 ----


def _truncated(folder: Path) -> Path:
    file = folder / "truncated.gguf"
    write_gguf(file, "Q8_0")
    data = file.read_bytes()
    file.write_bytes(data[: len(data) * 2 // 3])
    return file


def _bare(folder: Path) -> Path:
    file = folder / "no-tokenizer.gguf"
    write_gguf(file, tokenizer=False)
    return file


def _foreign(folder: Path) -> Path:
    file = folder / "bert.gguf"
    write_gguf(file, architecture="bert")
    return file


def _not_gguf(folder: Path) -> Path:
    file = folder / "notes.gguf"
    file.write_text("not a model, though named like one\n")
    return file


def _cut_in_header(folder: Path) -> Path:
    file = folder / "cut.gguf"
    write_gguf(file, "Q8_0")
    file.write_bytes(file.read_bytes()[:200])
    return file


def _empty(folder: Path) -> Path:
    file = folder / "empty.gguf"
    file.write_bytes(b"")
    return file


@pytest.mark.parametrize(
    "make, says",
    [
        (_truncated, "cannot be read: its tensor blk."),
        (_cut_in_header, "cannot be read: the file ends inside its header (truncated or damaged)."),
        (_empty, "cannot be read: the file is empty."),
        (_not_gguf, "cannot be read: it is not a GGUF file."),
        (_bare, "has no tokenizer"),
        (_foreign, "the bert architecture, which transformers cannot load from GGUF; it loads these families: "),
        (lambda folder: folder / "missing.gguf", "There is no GGUF file at"),
    ],
    ids=["truncated", "cut-in-header", "empty", "not-gguf", "no-tokenizer", "unsupported-architecture", "missing"],
)
def test_a_bad_gguf_file_is_refused_with_one_sentence(cache, tmp_path, capsys, make, says):
    file = make(tmp_path)
    code, out, err = cli(capsys, "generate", "--model", str(file), "--prompt", "hi", "--max-new-tokens", "4")
    sentence = refused(code, out, err)
    assert says in sentence and str(file) in sentence and sentence.endswith(".")
    if make is _foreign:
        assert "llama" in sentence and "qwen2" in sentence
    assert not list((cache / "medusa-chat" / "models").glob(".convert-*"))  # nothing half-written left


def test_a_conversion_that_the_disk_cannot_hold_is_refused_before_it_starts(cache, tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    from models import gguf_files

    monkeypatch.setattr(gguf_files.shutil, "disk_usage", lambda _: SimpleNamespace(free=10_000))
    file = tmp_path / "model.gguf"
    write_gguf(file, "Q4_0", seed=11)
    args = ("--prompt", "hi", "--max-new-tokens", "4", "--quantization", "none")  # int4 converts nothing
    code, out, err = cli(capsys, "generate", "--model", str(file), *args)
    *progress, last = err.strip().splitlines()  # the file described, and the model's size said, before
    assert [line.split(" ", 1)[0] for line in progress] == ["Reading", "Loading"]
    sentence = refused(code, out, last)
    assert "MB free in" in sentence and "which has 0.0 MB; free some space" in sentence  # nor was it started


# ---- the embedded file, given by path ----


@pytest.mark.embedded
def test_the_embedded_file_given_by_path_replies_like_the_embedded_model(cache, capsys):
    from models.embedded import EMBEDDED_ID, embedded_gguf

    by_path, said = generate(capsys, str(embedded_gguf()), "--mode", "baseline")
    assert f"Loading {embedded_gguf()} (4-bit int4)" in said
    assert by_path == generate(capsys, EMBEDDED_ID, "--mode", "baseline")[0]
    assert generate(capsys, str(embedded_gguf()))[0] == by_path  # the tree, without trained heads


# ---- --quantization auto on a CPU ----


def test_auto_quantization_on_a_cpu_is_int4_for_a_model_the_lean_forward_serves(cache, tmp_path, capsys):
    from transformers import GPT2Config

    from models.loader import load_backbone
    from models.quantization import pick_quantization

    require_kernel("int4", torch.bfloat16)
    spec = save_tiny_model(tmp_path / "tiny")
    cpu = torch.device("cpu")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=1)
    assert pick_quantization("auto", cpu, config) == "int4"
    assert pick_quantization("auto", cpu, config, "float32") == "none"  # a dtype asked for: that precision
    assert pick_quantization("none", cpu, config) == "none"
    assert pick_quantization("auto", cpu, GPT2Config(n_embd=64, n_layer=1, n_head=4)) == "none"  # not servable
    capsys.readouterr()
    four_bit = load_backbone(spec.name, device="cpu", spec=spec)
    assert four_bit.backend.layer_kernel in ("int4", "q4")
    assert f"Loading {spec.name} (4-bit int4): about" in capsys.readouterr().err
    full = load_backbone(spec.name, device="cpu", quantization="none", spec=spec)
    assert full.backend.layer_kernel not in ("int4", "q4") and full.model.dtype in (torch.float32, torch.bfloat16)
    assert "4-bit" not in capsys.readouterr().err


def test_a_models_package_in_the_working_folder_does_not_stand_in_for_ours(files, tmp_path, monkeypatch):
    """The describing process runs where our `models` package is: a user's working folder with a
    `models` package of its own (and a relative path to the file) describes as anywhere else."""
    from models import gguf_files

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("raise SystemExit('not ours')\n")
    file = files["Q4_0"][0]
    (tmp_path / "here.gguf").write_bytes(file.read_bytes())
    monkeypatch.chdir(tmp_path)
    folder = gguf_files.describe(Path("here.gguf"), tmp_path / "described")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
