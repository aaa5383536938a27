"""The models the lean forward runs, built without transformers' model code.

transformers' model classes import its whole loading machinery with them (modeling_utils, and
through it torch.distributed's tensors, torch._dynamo and sympy): ~110 MB held and ~2.5 s at
every start, for a model whose forward the lean backend runs from its own modules anyway. A GGUF
file's model needs none of it: its description (`models.gguf_files`) holds a complete config, and
the lean forward reads only the modules' parameters, norms' epsilons and the rotary tables. This
builds those modules under transformers' names (`models.direct` fills them a tensor at a time),
for the families `lean.servable` takes with static rotary tables ("default", "linear", "llama3":
`ROPE_TYPES`); any other model keeps transformers' classes.

What the model computes is transformers' own: the rotary tables by transformers' functions and in
its order of operations, Gemma's embedding scale and norms as its classes hold them (tested
against transformers' modules family by family: the same parameters, tables and logits). Where
transformers' forward or classes are wanted after all — training and calibration read hidden
states through it (`CausalLM.hf_model`: transformers' model sharing these modules), an EAGLE draft
layer is built of the family's classes (`CausalLM.hf_parts`) — they are imported then.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn
from transformers.configuration_utils import PretrainedConfig

FAMILIES = {  # model_type → its class in config.json
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
HEAD_NORMS = ("qwen3", "gemma3_text")  # an RMSNorm over each head of q and k
ROPE_TYPES = ("default", "linear", "llama3")  # rotary tables computed once (no dynamic update)
NEEDED = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "rms_norm_eps",
    "max_position_embeddings", "rope_parameters",
)  # fmt: skip


class LightConfig(PretrainedConfig):
    """A config.json read as it is, by transformers' generic config (a model class's config would
    import its model code): the models this module builds."""


def config_of(folder: Path) -> LightConfig | None:
    """`folder`'s config.json where this module builds its model; else None."""
    try:
        config = LightConfig.from_json_file(str(Path(folder) / "config.json"))
    except (OSError, ValueError, TypeError):
        return None
    return config if buildable(config) else None


def read_config(folder: Path, gguf: bool = False):
    """`folder`'s config: a GGUF file's description's as this module builds it where it does (no
    model code imported), else transformers' class's for the family."""
    if gguf and (config := config_of(folder)) is not None:
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def buildable(config) -> bool:
    """Whether this module builds the model of `config`: a family it knows, whose config.json
    says every value its modules read (a GGUF file's description does), with static rotary tables."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES or getattr(config, "quantization_config", None):
        return False
    if (getattr(config, "architectures", None) or [FAMILIES[kind]])[0] != FAMILIES[kind]:
        return False
    if any(getattr(config, name, None) is None for name in NEEDED):
        return False
    return all(params.get("rope_type", "default") in ROPE_TYPES for params in _rope_tables(config).values())


def _rope_tables(config) -> dict[str | None, dict]:
    """The rotary parameters by layer type (Gemma 3's), or {None: them} for every layer."""
    params = config.rope_parameters
    if getattr(config, "layer_types", None) and all(kind in params for kind in set(config.layer_types)):
        return {kind: params[kind] for kind in sorted(set(config.layer_types))}
    return {None: params}


def generation_config(folder: Path):
    """The folder's generation config (its end tokens), as transformers reads it."""
    from transformers.generation.configuration_utils import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(folder))
    except (OSError, ValueError):
        return GenerationConfig()


class Linear(nn.Linear):
    """nn.Linear whose weights are left as they are made: a file fills them (initializing them on
    the meta device would import torch's meta kernels, and sympy with them)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding left as it is made, as `Linear`."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """An RMSNorm's weight and epsilon (the lean forward computes it: `lean.layer.Norm`);
    `unit_offset`: Gemma's, which scales by 1 + its weight."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.variance_epsilon = self.eps = eps
        self.unit_offset = unit_offset


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: by 1 + its weight (a class of its own, as transformers' is)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps, unit_offset=True)


class ScaledEmbedding(Embedding):
    """Gemma's embedding: the table's rows times √hidden, in the table's dtype."""

    def __init__(self, vocab: int, hidden: int, padding_idx: int | None) -> None:
        super().__init__(vocab, hidden, padding_idx)
        self.scalar_embed_scale = hidden**0.5
        self.embed_scale = nn.Buffer(torch.tensor(self.scalar_embed_scale), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class Attention(nn.Module):
    def __init__(self, config, kind: str, head_dim: int) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        bias = kind == "qwen2" or bool(getattr(config, "attention_bias", False))
        self.q_proj = Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, kv * head_dim, bias=bias)
        self.v_proj = Linear(hidden, kv * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias and kind != "qwen2")
        if kind in HEAD_NORMS:
            norm = GemmaRMSNorm if kind == "gemma3_text" else RMSNorm
            self.q_norm, self.k_norm = norm(head_dim, config.rms_norm_eps), norm(head_dim, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, config, kind: str) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        bias = kind == "llama" and bool(getattr(config, "mlp_bias", False))
        self.gate_proj = Linear(hidden, inner, bias=bias)
        self.up_proj = Linear(hidden, inner, bias=bias)
        self.down_proj = Linear(inner, hidden, bias=bias)


class DecoderLayer(nn.Module):
    """A decoder layer's modules under transformers' names: `(config, index)` as its classes take."""

    def __init__(self, config, index: int) -> None:
        super().__init__()
        kind, eps = config.model_type, config.rms_norm_eps
        gemma = kind == "gemma3_text"
        norm = GemmaRMSNorm if gemma else RMSNorm
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.self_attn = Attention(config, kind, head_dim)
        self.mlp = MLP(config, kind)
        self.input_layernorm, self.post_attention_layernorm = (
            norm(config.hidden_size, eps),
            norm(config.hidden_size, eps),
        )
        if gemma:  # the sandwich: a norm on the attention's and the MLP's outputs too
            self.pre_feedforward_layernorm = norm(config.hidden_size, eps)
            self.post_feedforward_layernorm = norm(config.hidden_size, eps)


class Rotary(nn.Module):
    """The rotary cos and sin of every layer: transformers' `...RotaryEmbedding` for one table."""

    def __init__(self, config) -> None:
        super().__init__()
        self.inv_freq, self.attention_scaling = _inverse_frequencies(config, None)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        return _cos_sin(x, position_ids, self.inv_freq, self.attention_scaling)


class TypedRotary(nn.Module):
    """Gemma 3's: a table per kind of layer ("sliding_attention", "full_attention")."""

    def __init__(self, config) -> None:
        super().__init__()
        self.tables = {kind: _inverse_frequencies(config, kind) for kind in _rope_tables(config)}

    def forward(self, x: Tensor, position_ids: Tensor, layer_type: str) -> tuple[Tensor, Tensor]:
        return _cos_sin(x, position_ids, *self.tables[layer_type])


def _inverse_frequencies(config, layer_type: str | None) -> tuple[Tensor, float]:
    """(inverse frequencies in float32, the cos/sin scale) as transformers computes them."""
    params = config.rope_parameters[layer_type] if layer_type is not None else config.rope_parameters
    kind = params.get("rope_type", "default")
    if kind == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config, None, **kwargs)
    return inv_freq.float(), scale


def _cos_sin(x: Tensor, position_ids: Tensor, inv_freq: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype=x.dtype), (emb.sin() * scale).to(dtype=x.dtype)


class Decoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        kind, pad = config.model_type, getattr(config, "pad_token_id", None)
        pad = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None
        if kind == "gemma3_text":
            self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, pad)
        else:
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, pad)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = (GemmaRMSNorm if kind == "gemma3_text" else RMSNorm)(config.hidden_size, config.rms_norm_eps)
        with torch.device("cpu"):  # computed, never read from a file
            self.rotary_emb = TypedRotary(config) if None not in _rope_tables(config) else Rotary(config)


class CausalLM(nn.Module):
    """A causal LM's modules under transformers' names, for the lean forward (`lean.accelerate`):
    it has no forward of its own."""

    def __init__(self, config, generation=None) -> None:
        super().__init__()
        self.config, self.generation_config, self._hf = config, generation, None
        self.model = Decoder(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def base_model(self) -> Decoder:
        return self.model

    @property
    def dtype(self) -> torch.dtype:
        return next(p for p in self.parameters() if p.is_floating_point()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, module: nn.Module) -> None:
        self.model.embed_tokens = module

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, module: nn.Module) -> None:
        self.lm_head = module

    def forward(self, *args, **kwargs):
        raise NotImplementedError("this model runs on the lean forward; hf_model() runs transformers' forward")

    def hf_model(self) -> nn.Module:
        """transformers' model of this one, sharing its modules (packed or not) and norm weights:
        what training and calibration run transformers' forward on, as on a model transformers
        built (its model code imported now). Made once."""
        if self._hf is None:
            hf = skeleton(self.hf_parts()[0], self.dtype)
            hf.generation_config = self.generation_config
            _graft(self, hf)
            self.__dict__["_hf"] = hf  # not a submodule: its modules are this model's
        return self._hf

    def hf_parts(self) -> tuple:
        """transformers' own config, decoder layer, norm and rotary classes for this model (its model
        code imported now): what an EAGLE draft layer trained for it is built of."""
        import importlib

        from transformers import AutoConfig

        kind = self.config.model_type
        values = {k: v for k, v in self.config.to_dict().items() if k != "model_type"}
        family = kind.removesuffix("_text")
        code = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        prefix = FAMILIES[kind].removesuffix("ForCausalLM")
        parts = ("DecoderLayer", "RMSNorm", "RotaryEmbedding")
        return AutoConfig.for_model(kind, **values), *(getattr(code, prefix + part) for part in parts)


def _graft(light: CausalLM, hf: nn.Module) -> None:
    """`hf` (transformers' skeleton of the same config) made of `light`'s modules: its embedding,
    lm_head and each layer's projections (packed or not, fused groups and their parts) as they are,
    its norms' weights into transformers' own norms (their forward is the family's)."""
    hf.model.embed_tokens, hf.lm_head = light.model.embed_tokens, light.lm_head
    hf.model.norm.weight = light.model.norm.weight
    for ours, theirs in zip(light.model.layers, hf.model.layers, strict=True):
        pairs = [(ours, theirs), (ours.self_attn, theirs.self_attn), (ours.mlp, theirs.mlp)]
        for mine, its in pairs:
            for leaf, module in mine.named_children():
                if isinstance(module, RMSNorm):
                    getattr(its, leaf).weight = module.weight
                elif mine is not ours:
                    setattr(its, leaf, module)


def skeleton(config, dtype: torch.dtype, folder: Path | None = None) -> nn.Module:
    """The model of `config` with its parameters on the meta device (no memory) in `dtype` and its
    non-persistent buffers (rotary tables, Gemma's embedding scale) computed on the CPU, as
    `from_pretrained` has them: this module's where `config` is a `LightConfig` (its generation
    config read from `folder`), else transformers' class's."""
    if not isinstance(config, LightConfig):
        return _transformers_skeleton(config, dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_config(dtype=…): parameters and the embedding scale in it
    try:
        with torch.device("meta"):
            model = CausalLM(config, generation_config(folder) if folder is not None else None)
    finally:
        torch.set_default_dtype(default)
    embedding = model.get_input_embeddings()
    if isinstance(embedding, ScaledEmbedding):
        embedding.embed_scale = torch.tensor(embedding.scalar_embed_scale, dtype=dtype)
    return model.eval()


def _transformers_skeleton(config, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    owners = {name.rpartition(".")[0] for name, _ in model.named_non_persistent_buffers()}
    for owner in owners:
        module = model.get_submodule(owner)
        for key, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[key] = torch.empty_like(buffer, device="cpu")
        model._init_weights(module)
    return model.eval()


def on_meta(config) -> nn.Module:
    """The model of `config` on the meta device (its shapes, no memory): this module's where it
    builds it, else transformers' class's."""
    if isinstance(config, LightConfig):
        with torch.device("meta"):
            return CausalLM(config)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
