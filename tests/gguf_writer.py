"""GGUF files written from a transformers model, as llama.cpp's converter and quantizer write them:
Llama and Qwen2 models (the random-weight test files: tiny ones for CI, real shapes for speed and
memory checks), with the embedded SmolLM2 file's tokenizer metadata, so the files tokenize.

A file's `mix` is what llama.cpp's `llama-quantize` calls its type, with the same choices per tensor
(`llama_tensor_get_type`): "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K", "Q4_K_M", "Q5_K_M", "F16",
"F32". In the 4- and 5-bit mixes the output matrix (or, with tied embeddings, the token embedding)
is Q6_K; Q4_K_M (Q5_K_M) is Q4_K (Q5_K) but for attn_v and ffn_down in the layers llama.cpp gives
more bits (the first and last eighth, and every third between), which are Q6_K. A K-type tensor
whose rows are not a multiple of 256 falls back as llama.cpp's does (Q4_K → Q5_0, Q5_K → Q5_1,
Q6_K → Q8_0). The `gguf` package quantizes the 32-element types; Q4_K, Q5_K and Q6_K, which it
only dequantizes, are quantized here (plain min/max scales, not llama.cpp's search: the layout is
the same, the rounding error slightly larger).

    python -m tests.gguf_writer folder qwen2.5-1.5b /work/rand/1.5b   # a random-weight folder
    python -m tests.gguf_writer gguf /work/rand/1.7b Q4_K_M /work/rand/gguf/smollm2-1.7b-random.Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

QK_K = 256
# the Llama-family tensors as llama.cpp's converter names them
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}  # transformers' model_type → GGUF architecture
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1",
              "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q8_0": "MOSTLY_Q8_0", "Q6_K": "MOSTLY_Q6_K",
              "Q4_K_M": "MOSTLY_Q4_K_M", "Q5_K_M": "MOSTLY_Q5_K_M"}  # fmt: skip
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama.cpp's, for rows that are no multiple of 256
# real shapes (the published configs), for random-weight speed and memory checks
SHAPES = {
    "smollm2-1.7b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, rope_theta=130000.0, vocab_size=49152, max_position_embeddings=8192,
        tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, rope_theta=1000000.0, vocab_size=151936, max_position_embeddings=32768,
        tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip


# ---- the quantizers gguf.quants lacks ----


def _k_blocks(rows: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """(n, 256) float32 → what Q4_K (levels 15) and Q5_K (31) blocks share: d, dmin (f16), 8 six-bit
    scales and mins packed in 12 bytes, and the (n, 8, 32) values in [0, levels]; value =
    d·scale·q − dmin·min, per 32-element sub-block."""
    n = rows.shape[0]
    x = rows.reshape(n, 8, 32)
    low, high = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    scale, least = (high - low) / levels, -low
    d = _f16(scale.max(-1, keepdims=True) / 63)
    dmin = _f16(least.max(-1, keepdims=True) / 63)
    sc = np.clip(np.round(_divide(scale, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_divide(least, dmin)), 0, 63).astype(np.uint8)
    step, offset = (d * sc)[..., None], (dmin * mn)[..., None]
    q = np.clip(np.round(_divide(x + offset, step)), 0, levels).astype(np.uint8)
    scales = np.concatenate(
        [(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1,
    )  # fmt: skip
    return _f16_bytes(d), _f16_bytes(dmin), scales, q


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """(n, 256) float32 → (n, 144) Q4_K blocks: d, dmin, the packed scales and mins, then 256 four-bit
    values (sub-blocks 2c and 2c + 1 in the low and high nibbles of 32 bytes)."""
    d, dmin, scales, q = _k_blocks(rows, 15)
    return np.concatenate([d, dmin, scales, (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(q), 128)], axis=1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    """(n, 256) float32 → (n, 176) Q5_K blocks: Q4_K's with 31 steps a sub-block and the values'
    fifth bits (bit g of byte i: sub-block g's value i) between the scales and the low nibbles."""
    d, dmin, scales, q = _k_blocks(rows, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # (n, 32)
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(len(q), 128)
    return np.concatenate([d, dmin, scales, qh, qs], axis=1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """(n, 256) float32 → (n, 210) Q6_K blocks: 256 six-bit values (low nibbles, then high bit
    pairs), 16 int8 scales, d (f16); value = d·scale·(q − 32), per 16-element sub-block."""
    n = rows.shape[0]
    x = rows.reshape(n, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = _f16(scale.max(-1, keepdims=True) / 127)
    sc = np.clip(np.round(_divide(scale, d)), -128, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = (np.clip(np.round(_divide(x, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    low, high = q & 15, q >> 4
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).astype(np.float32)  # as stored, so the values fit the stored scale


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(values.shape[0], 2)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def quantize(weight: np.ndarray, kind: str) -> np.ndarray:
    """`weight` (out, in) float32 as the raw bytes of GGML type `kind`, a row of blocks per row; a
    type nothing here quantizes as zero blocks (for files that must be refused)."""
    import gguf

    ours = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
    if kind in ours:
        blocks = ours[kind](weight.reshape(-1, QK_K).astype(np.float32))
        return blocks.reshape(weight.shape[0], -1)
    try:
        return gguf.quants.quantize(weight, gguf.GGMLQuantizationType[kind])
    except NotImplementedError:
        size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        return np.zeros((weight.shape[0], weight.shape[1] // size * nbytes), dtype=np.uint8)


# ---- which type each tensor gets ----


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], mix: str, layers: int, tied: bool) -> str:
    """The GGML type llama.cpp's quantizer gives tensor `name` (GGUF naming) in a `mix` file."""
    if len(shape) == 1 or mix == "F32":
        return "F32"
    if mix == "F16":
        return "F16"
    output = name == "output.weight" or (tied and name == "token_embd.weight")
    if output:
        kind = "Q8_0" if mix == "Q8_0" else "Q6_K"
    elif mix in ("Q4_K_M", "Q5_K_M"):
        layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
        wide = name.endswith(("attn_v.weight", "ffn_down.weight")) and _more_bits(layer, layers)
        kind = "Q6_K" if wide else mix[:4]
    else:
        kind = mix
    if kind in FALLBACK and shape[-1] % QK_K:
        kind = FALLBACK[kind]
    return kind if shape[-1] % 32 == 0 else "F16"


# ---- the file ----


@functools.cache
def embedded_tokenizer() -> tuple[tuple[str, object, list], ...]:
    """The tokenizer.* metadata of the embedded SmolLM2 file: (key, value, [value type, item type])."""
    import gguf

    from models.embedded import embedded_gguf

    reader = gguf.GGUFReader(embedded_gguf())
    return tuple(
        (key, field.contents(), list(field.types))
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.")
    )


def _add_tokenizer(writer, vocab: int) -> None:
    """The embedded file's tokenizer, its lists padded with unused tokens up to `vocab` where the
    model's vocabulary is larger (as llama.cpp's converter pads Qwen's with [PAD…] tokens)."""
    import gguf

    padding = {"tokenizer.ggml.tokens": lambda i: f"[PAD{i}]", "tokenizer.ggml.token_type": lambda i: 5}
    padding["tokenizer.ggml.scores"] = lambda i: -1000.0  # UNUSED above
    for key, value, types in embedded_tokenizer():
        if key in padding and len(value) < vocab:
            value = list(value) + [padding[key](i) for i in range(len(value), vocab)]
        sub = types[1] if types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, types[0], sub_type=sub)


def _add_shape(writer, config, mix: str) -> None:
    import gguf

    heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") or getattr(config, "rope_theta", 10000.0)
    writer.add_name(f"random {config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(theta))
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(int(gguf.LlamaFileType[FILE_TYPES[mix]]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def gguf_name(name: str, layers: int) -> str:
    """A transformers tensor name as llama.cpp's converter writes it."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    if name in fixed:
        return fixed[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.I.self_attn.q_proj.weight
    module, _, what = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{what}"


def _permuted(weight: np.ndarray, heads: int) -> np.ndarray:
    """q and k rows in llama.cpp's rotary order (its converter's `permute`, for llama only)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    path: Path, config, tensors: Iterable[tuple[str, torch.Tensor]], mix: str = "Q4_0",
    tokenizer: bool = True, override: dict[str, str] | None = None,
) -> dict[str, str]:  # fmt: skip
    """The model of `config` with `tensors` (transformers names) as a GGUF file at `path`, its
    matrices in `mix` (see the module's docstring) but for the GGUF names in `override` (→ their
    type), with the embedded file's tokenizer unless not `tokenizer`. Returns {GGUF name: type}."""
    import gguf

    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"writes {', '.join(ARCHITECTURES)} models, not {config.model_type}")
    architecture = ARCHITECTURES[config.model_type]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    layers = config.num_hidden_layers
    writer = gguf.GGUFWriter(path, architecture)
    _add_shape(writer, config, mix)
    if tokenizer:
        _add_tokenizer(writer, config.vocab_size)
    types = {}
    for name, tensor in tensors:
        if tied and name == "lm_head.weight":
            continue
        weight = tensor.detach().float().numpy()
        target = gguf_name(name, layers)
        if architecture == "llama" and target.endswith(("attn_q.weight", "attn_k.weight")):
            weight = _permuted(weight, config.num_attention_heads if "attn_q" in target else config.num_key_value_heads)
        kind = (override or {}).get(target) or tensor_type(target, weight.shape, mix, layers, tied)
        types[target] = kind
        if kind == "F32":
            writer.add_tensor(target, weight)
        elif kind == "F16":
            writer.add_tensor(target, weight.astype(np.float16))
        else:
            blocks = quantize(weight, kind)
            writer.add_tensor(target, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def dequantized_copy(source: Path, target: Path) -> Path:
    """`source` with every tensor dequantized to F32 and its metadata as it is: the same model and
    weights, which llama.cpp then computes on without quantizing its activations (the reference
    its quantized computation, and ours, are measured against in tests/agreement.py)."""
    import gguf

    reader = gguf.GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type", "general.alignment"):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(
            tensor.name, np.ascontiguousarray(values, dtype=np.float32).reshape(tuple(reversed(tensor.shape)))
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def folder_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """A transformers folder's tensors one at a time (a real-shape model never whole in float32)."""
    from safetensors import safe_open

    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is no dict)
                yield name, weights.get_tensor(name)


def write_from_folder(path: Path, folder: Path, mix: str) -> dict[str, str]:
    from transformers import AutoConfig

    return write_gguf(path, AutoConfig.from_pretrained(folder), folder_tensors(folder), mix)


def random_config(shape: str | dict):
    """A transformers config of one of `SHAPES` (or the dict of one)."""
    from transformers import AutoConfig

    options = dict(SHAPES[shape] if isinstance(shape, str) else shape)
    return AutoConfig.for_model(options.pop("model_type"), **options)


def random_folder(shape: str, out: Path, seed: int = 0) -> Path:
    """A random-weight bf16 folder of a real shape with the embedded model's tokenizer (what
    /work/notes/make_random.py made for SmolLM2's shapes): plumbing, speed and memory checks only."""
    from transformers import AutoModelForCausalLM

    from models.embedded import embedded_dir

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(random_config(shape)).to(torch.bfloat16)
    model.save_pretrained(out)
    for file in embedded_dir().iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(file, out / file.name)
    generation = {"bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.gguf_writer", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    folder = commands.add_parser("folder", help="a random-weight transformers folder of a real shape")
    folder.add_argument("shape", choices=sorted(SHAPES))
    folder.add_argument("out", type=Path)
    file = commands.add_parser("gguf", help="a GGUF file from a transformers folder")
    file.add_argument("folder", type=Path)
    file.add_argument("mix", choices=sorted(FILE_TYPES))
    file.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "folder":
        print(random_folder(args.shape, args.out))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    types = write_from_folder(args.out, args.folder, args.mix)
    counts = {kind: list(types.values()).count(kind) for kind in sorted(set(types.values()))}
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB, tensors by type {counts}", file=sys.stderr)


if __name__ == "__main__":
    main()
