"""Medusa heads written in the layouts serving engines load, so the heads trained here serve
with vLLM or Text Generation Inference when one machine is no longer enough.

- vLLM (`vllm/model_executor/models/medusa.py`, config `transformers_utils/configs/medusa.py`):
  `config.json` with `model_type` "medusa", `num_heads`, `num_hidden_layers`, `hidden_size`,
  `vocab_size`, `truncated_vocab_size`, `medusa_fc_bias` (the residual linears' bias; dropped
  silently when false) and `original_lm_head` (one shared vocabulary projection); tensors
  `blocks.{i}.layers.{j}.weight|bias`, `lm_heads.{i}.weight` (the draft never borrows the
  target's lm_head, so a shared one is written once as `lm_heads.0.weight`) and `token_map`
  (the vocabulary subset a shared head reads out over; vLLM slices the projection by it).
- TGI (`server/text_generation_server/layers/medusa.py`): `config.json` with
  `medusa_num_heads`, `medusa_num_layers` and `base_model_name_or_path`, and *no*
  `architectures` key (TGI takes a config with one for another kind of speculator); tensors in
  `medusa_lm_head.safetensors` with FasterDecoding's names, `{i}.{j}.linear.weight|bias`, and
  `{i}.{layers}.weight` per head (V1). One-layer heads on the backbone's lm_head load as V2,
  which reads out every head through the backbone's own lm_head, so no projection is written.
  TGI has no vocabulary subset: such heads read out over the whole vocabulary there.
- SGLang serves EAGLE drafters and no Medusa heads (sgl-project/sglang#859), so there is
  nothing to write for it yet.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from core.errors import UserError
from models.heads import CONFIG, WEIGHTS, MedusaHeads

FORMATS = ("vllm", "tgi", "sglang")
VLLM_WEIGHTS = "model.safetensors"
DTYPE = torch.bfloat16  # of the written tensors (the engines cast to the dtype they serve in)


def check_format(fmt: str) -> None:
    """A UserError unless Medusa heads can be written for `fmt`."""
    if fmt not in FORMATS:
        raise UserError(f"Unknown export format '{fmt}'; choose one of {', '.join(FORMATS)}.")
    if fmt == "sglang":
        raise UserError(
            "SGLang serves EAGLE drafters, not Medusa heads (sgl-project/sglang#859); "
            "export --format vllm or tgi instead."
        )


def export_heads(heads: MedusaHeads, lm_head: Tensor, out: Path, fmt: str, base_model: str) -> str:
    """Write `heads` (their backbone's projection `lm_head`, (V, H)) to the folder `out` in the
    layout of `fmt`; returns the command that serves them with the model at `base_model`."""
    check_format(fmt)
    out.mkdir(parents=True, exist_ok=True)
    # "{i}.{j}.linear.*" (and "{i}.{layers}.weight"), in bf16 as heads are trained and shipped here
    blocks = {k: v.detach().to(DTYPE).contiguous() for k, v in heads.heads.state_dict().items()}
    lm_head = lm_head.detach().to(DTYPE)
    if fmt == "vllm":
        tensors, config = _vllm(heads, blocks, lm_head)
        save_file(tensors, out / VLLM_WEIGHTS)
        spec = {"method": "medusa", "model": str(out), "num_speculative_tokens": heads.num_heads}
        command = f"vllm serve {base_model} --speculative-config '{json.dumps(spec)}'"
    else:
        tensors, config = _tgi(heads, blocks, lm_head, base_model)
        save_file(tensors, out / WEIGHTS)
        command = f"text-generation-launcher --model-id {out} --speculate {heads.num_heads}"
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return command


def _vllm(heads: MedusaHeads, blocks: dict[str, Tensor], lm_head: Tensor) -> tuple[dict[str, Tensor], dict]:
    tensors = {}
    for name, value in blocks.items():
        head, index, *rest = name.split(".")
        if int(index) < heads.num_layers:  # "{i}.{j}.linear.weight" → "blocks.{i}.layers.{j}.weight"
            tensors[f"blocks.{head}.layers.{index}.{rest[-1]}"] = value
        else:  # a head's own projection, "{i}.{layers}.weight"
            tensors[f"lm_heads.{head}.weight"] = value
    vocab = heads.vocab_size
    if heads.shared:
        tensors["lm_heads.0.weight"] = lm_head.contiguous()
    subset = heads.token_ids
    if subset is not None:
        tensors["token_map"] = subset.detach().cpu().long().contiguous()
    config = {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": heads.hidden_size,
        "vocab_size": vocab, "num_heads": heads.num_heads, "num_hidden_layers": heads.num_layers,
        "truncated_vocab_size": vocab if subset is None else len(subset), "medusa_fc_bias": True,
        "original_lm_head": heads.shared,
    }  # fmt: skip
    return tensors, config


def _tgi(
    heads: MedusaHeads, blocks: dict[str, Tensor], lm_head: Tensor, base_model: str
) -> tuple[dict[str, Tensor], dict]:
    tensors = dict(blocks)
    if heads.shared and heads.num_layers != 1:  # V1 only: every head needs a projection of its own
        tensors |= {f"{i}.{heads.num_layers}.weight": lm_head.clone() for i in range(heads.num_heads)}
    config = {
        "medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
        "base_model_name_or_path": base_model, "hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size,
    }  # fmt: skip
    return tensors, config
