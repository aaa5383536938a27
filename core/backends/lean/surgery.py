"""Model surgery for the lean backend: which models it serves, and their linear layers swapped in
place for `PackedLinear`s (q/k/v and gate/up fused into one matmul each)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from core.backends import q4
from core.backends.lean.backend import LeanBackend, cost_grows_by_row
from core.backends.lean.layer import act_name
from core.backends.lean.packed import BITS, LIBRARY, PackedEmbedding, PackedLinear, TiedHead

# model_type values whose decoder layers the lean forward reproduces
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
WINDOWED = ("gemma3_text",)  # the families whose sliding-window layers it reproduces


def servable(config) -> bool:
    """Whether the lean forward reproduces the forward of a model with this (transformers) config."""
    text = config.get_text_config()
    if text.model_type not in SUPPORTED or getattr(config, "quantization_config", None):
        return False
    if text.model_type in WINDOWED:  # the text model alone (Gemma3ForCausalLM), causal, no attention softcapping
        return (
            config.model_type == text.model_type
            and act_name(text) == "gelu_tanh"
            and getattr(text, "attn_logit_softcapping", None) is None
            and not getattr(text, "use_bidirectional_attention", False)
        )
    return act_name(text) == "silu" and not any("sliding" in t for t in (getattr(text, "layer_types", None) or []))


class Part(nn.Module):
    """Columns [start, stop) of a fused PackedLinear's output: what the original q/k/v or
    gate/up projection returned, so the transformers forward still works after fusing."""

    def __init__(self, fused: PackedLinear, start: int, stop: int) -> None:
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop

    def forward(self, x: Tensor) -> Tensor:
        return self.fused(x)[..., self.start : self.stop]


GROUPS = (  # a decoder layer's linear layers as `LeanLayer` runs them: (parent, packed name, parts)
    ("self_attn", "qkv", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)


def _fuse(parent: nn.Module, names: tuple[str, ...], kernel: str) -> PackedLinear:
    """One PackedLinear over the concatenated outputs of `parent`'s linear layers `names`."""
    parts = [getattr(parent, n) for n in names]
    weight = parts[0].weight if len(parts) == 1 else torch.cat([p.weight for p in parts])
    return PackedLinear(weight, _bias(parts), kernel)


def _bias(parts: list[nn.Linear]) -> Tensor | None:
    """The concatenated biases of `parts` (zeros for one without), None where none has one."""
    some = next((p.bias for p in parts if p.bias is not None), None)
    if some is None:
        return None
    return torch.cat([p.bias if p.bias is not None else some.new_zeros(p.out_features) for p in parts])


def _install(parent: nn.Module, name: str, names: tuple[str, ...], packed: PackedLinear) -> None:
    """`packed` in place of `parent`'s linear layers `names`: itself for one, as `name` with a
    Part for each of several."""
    if len(names) == 1:
        setattr(parent, names[0], packed)
        return
    setattr(parent, name, packed)
    start = 0
    for one in names:
        stop = start + getattr(parent, one).out_features
        setattr(parent, one, Part(packed, start, stop))
        start = stop


def pack_layer(layer: nn.Module, kernel: str) -> None:
    """Pack one decoder layer's linear layers in place (q/k/v and gate/up fused), for `LeanLayer`
    (a group `PackAsRead` packed is kept)."""
    for parent_name, name, names in GROUPS:
        parent = getattr(layer, parent_name)
        if isinstance(getattr(parent, names[0]), nn.Linear):
            _install(parent, name, names, _fuse(parent, names, kernel))


class PackAsRead:
    """A decoder layer's linear weights packed for the library's kernel as a load reads them, each
    into its rows of the packed (fused) weight: the load holds one weight in full precision at a
    time, not the layer's (at 1.7B: 34 MB instead of 134, and no fused copy beside them). The
    rows' bytes are those `pack_layer` gives (a row is quantized on its own). `kernels`: a fused
    weight's own kernel by its packed name ("qkv", "gate_up"…), where it is not `kernel`."""

    def __init__(self, layer: nn.Module, kernel: str, kernels: dict[str, str] | None = None) -> None:
        self.layer, self.kernel, self.kernels = layer, kernel, kernels or {}
        self.open: dict[str, tuple[PackedLinear, set[str]]] = {}  # packed name → it, the parts put

    def take(self, name: str, weight: Tensor) -> bool:
        """Whether the weight `name` (in the layer: "mlp.up_proj.weight") was packed; False: the
        caller sets it on the layer (not a linear weight, or a kernel or shape this does not take).
        The group's biases must be set on the layer before its last weight comes."""
        return self._put(name, lambda packed, first: packed.put(first, weight))

    def bits(self, name: str) -> int | None:
        """The bits the weight `name` is packed at (None: this packs none)."""
        group = _group(name)
        return BITS.get(self.kernels.get(group[1], self.kernel) if group else self.kernel)

    def take_blocks(self, name: str, blocks) -> bool:
        """As `take`, from the weight's blocks as a file holds them, in the form of `bits`
        (`q4.Packed.put_blocks`' parts: first row, then q, steps and, at 4 bits, minimums), taken
        as they are; False, and nothing read, where this does not pack it."""

        def put(packed: PackedLinear, first: int) -> None:
            for start, *block in blocks:
                packed.put_blocks(first + start, *block)

        return self._put(name, put)

    def _put(self, name: str, put) -> bool:
        """`put(packed, first row)` fills the weight `name`'s rows of its packed group; False where
        this does not pack it."""
        parent_name, _, leaf = name.removesuffix(".weight").rpartition(".")
        group = _group(name)
        kernel = self.kernels.get(group[1], self.kernel) if group else self.kernel
        if kernel not in LIBRARY or not name.endswith(".weight") or group is None:
            return False
        parent, _, names = getattr(self.layer, parent_name), *group[1:]
        widths = [getattr(parent, one).out_features for one in names]
        columns = getattr(parent, leaf).in_features
        if q4.library() is None or not all(q4.fits(width, columns) for width in widths):
            return False
        packed, done = self.open.setdefault(group[1], (PackedLinear.empty(sum(widths), columns, kernel), set()))
        put(packed.packed, sum(widths[: names.index(leaf)]))
        done.add(leaf)
        if len(done) == len(names):
            packed.set_bias(_bias([getattr(parent, one) for one in names]))
            _install(parent, group[1], names, packed)
            del self.open[group[1]]
        return True


def _group(name: str) -> tuple[str, str, tuple[str, ...]] | None:
    """The `GROUPS` entry of a layer's weight `name` ("mlp.up_proj.weight"), None where it is in none."""
    parent_name, _, leaf = name.removesuffix(".weight").rpartition(".")
    return next((g for g in GROUPS if g[0] == parent_name and leaf in g[2]), None)


def accelerate(
    model: nn.Module, kernel: str, head_kernel: str, by_row: Callable[[PackedLinear], bool] | None = None
) -> LeanBackend:
    """Pack the model's linear layers (in place) and return the lean backend over it, which every
    consumer of the model (the decode loop, the step-cost curve, head training) then runs.

    Decoder layers get `kernel` with q/k/v and gate/up fused into one matmul each; the lm_head
    gets `head_kernel` and keeps its `weight`, which Medusa heads read (a tied one on the 8-bit
    kernel is also the embedding: `share_vocabulary`; one already packed is kept).
    `by_row(head)`: whether a tree's logits go a node at a time (default: timed here, now; the
    loader passes `core.measure.kernels.head_by_row`, which remembers it)."""
    for layer in model.base_model.layers:
        if not any(isinstance(m, PackedLinear) for m in layer.modules()):  # else packed as it loaded
            pack_layer(layer, kernel)
    head = model.get_output_embeddings()
    if not isinstance(head, PackedLinear) and not share_vocabulary(model, head_kernel):
        packed = PackedLinear(head.weight, head.bias, head_kernel)
        packed.weight = head.weight
        model.set_output_embeddings(packed)
    backend = LeanBackend(model)
    backend.row_head = (by_row or cost_grows_by_row)(model.get_output_embeddings())
    return backend


def share_vocabulary(model: nn.Module, head_kernel: str, blocks=None) -> bool:
    """Where the model ties its lm_head to its embedding and the lm_head runs on the 8-bit kernel,
    make both one `TiedHead` (the embedding reads its rows) and drop the dense table: the
    vocabulary is then held once, at ~1.2 bytes a weight instead of the table's 2 plus the kernel's
    copy (a 262k × 640 vocabulary: 200 MB instead of 535). `blocks`: the table's 8-bit blocks as
    a file holds them (`TiedHead.from_blocks`: exact, and the embedding's weight may be unread);
    else its weight is quantized. Whether it did."""
    embedding = model.get_input_embeddings()
    weight = embedding.weight
    if (
        head_kernel != "q8"
        or not getattr(model.config.get_text_config(), "tie_word_embeddings", False)
        or (weight.is_meta and blocks is None)
        or weight.device.type not in ("cpu", "meta")
        or not q4.fits(*weight.shape)
        or q4.library() is None
    ):
        return False
    head = TiedHead(weight) if blocks is None else TiedHead.from_blocks(tuple(weight.shape), weight.dtype, blocks)
    model.set_output_embeddings(head)
    model.set_input_embeddings(PackedEmbedding(head, getattr(embedding, "embed_scale", None)))
    return True
