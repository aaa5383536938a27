"""Loading a backbone, its tokenizer and Medusa heads from a catalog id, a hub repo or a folder.

`resolve` turns what the user typed into local folders (downloading what is missing through
`models.hub`); `load_backbone` loads the model in the chosen dtype and quantization and says
how much memory it will take; `heads_for` finds the heads to draft with.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core import heap
from core.backends import lean, q4
from core.backends.base import Backend
from core.backends.torch import TorchBackend
from core.drafters.eagle import EagleDraft, load_draft
from core.drafters.retrieval import Corpus, load_corpus
from core.errors import UserError
from core.measure import costs, cpu_attention, kernels
from models import catalog, direct, gguf_files, gguf_tokenizer, hub, kv_choice, light
from models.choices import DTYPE_NAMES
from models.cpu import transpose_linears
from models.eagle_formats import EAGLE_FILES, load_published
from models.embedded import EMBEDDED_ID, cache_dir, embedded_described
from models.heads import MedusaHeads, load_heads
from models.quantization import bnb_config, estimate_gb, pick_quantization

if TYPE_CHECKING:  # transformers' model code is imported only where a model needs it (`models.light`)
    from transformers import PreTrainedModel

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
BACKBONE_FILES = ["*.json", "*.safetensors", "*.bin", "tokenizer.model", "*.txt"]
HEAD_FILES = ["config.json", "medusa_lm_head.safetensors", "medusa_lm_head.pt"]


@dataclass(frozen=True)
class ModelSpec:
    """What to load, as local folders."""

    name: str  # what the user typed
    folder: Path  # the backbone (config.json and weights)
    tokenizer_folder: Path
    heads_folder: Path | None  # default heads (catalog or shipped), None if there are none
    chat_template: str | None  # a template text that overrides the tokenizer's, if any
    tree: str  # default tree preset
    eagle: Path | None = None  # the model's EAGLE drafter: a shipped file or a published checkpoint's folder
    gguf: Path | None = None  # a GGUF file's weights (`folder` holds its config and tokenizer, read from it)


@dataclass(frozen=True)
class Backbone:
    name: str  # catalog id, hub repo or folder
    model: PreTrainedModel
    tokenizer: object  # a transformers tokenizer
    eos_ids: tuple[int, ...]  # tokens that end a reply
    chat_template: str | None = None
    folder: Path | None = None  # where the weights were loaded from
    backend: Backend | None = None  # the model's forward and cache (None: transformers' own over `model`)
    gguf: Path | None = None  # the GGUF file the weights were read from (`folder` then holds its config)

    def __post_init__(self) -> None:
        if self.backend is None and self.model is not None:
            object.__setattr__(self, "backend", TorchBackend(self.model))

    @property
    def pad_id(self) -> int:
        """The token batched prompts are padded with: the tokenizer's, else the first end token."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.eos_ids[0]

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        """One user message (and an optional system prompt) as prompt token ids."""
        if not prompt.strip():
            raise UserError("The prompt is empty; type a message first.")
        return self.encode_messages([{"role": "user", "content": prompt}], system)

    def encode_messages(self, messages: list[dict], system: str | None = None) -> list[int]:
        """A conversation ({"role", "content"} dicts, ending with the user's turn) as prompt ids,
        through the chat template (the catalog's or the tokenizer's)."""
        messages = ([{"role": "system", "content": system}] if system else []) + list(messages)
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:  # a base model: plain text, turns separated by blank lines
            return self.tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
        ids = self.tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _template(name: str | None) -> str | None:
    if name is None:
        return None
    return (resources.files("assets") / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def resolve(name: str, on_progress=None) -> ModelSpec:
    """A catalog id, a GGUF file, a local folder, or a hub repo id ("org/name") → local folders."""
    if name == EMBEDDED_ID:
        folder, gguf = embedded_described()
        entry = catalog.find(name)
        tree = entry.tree if entry else "cpu-16"
        return ModelSpec(name, folder, folder, shipped_heads_dir(name), None, tree, shipped_eagle(name), gguf)
    if gguf_files.is_gguf(name):  # a GGUF file: its config and tokenizer written once (keyed by its hash)
        folder = gguf_files.described_folder(Path(name))
        return ModelSpec(name, folder, folder, None, None, "cpu-16", gguf=Path(name).expanduser())
    if entry := catalog.find(name):
        label = entry.id
        if entry.gguf:  # a CPU entry: its one GGUF file, then opened as any GGUF file is
            return resolve(str(_fetch_source(entry.gguf, label, on_progress) / entry.gguf_file), on_progress)
        folder = _fetch_source(entry.backbone, label, on_progress, weights=True)
        tokenizer = _fetch_source(entry.tokenizer, label, on_progress) if entry.tokenizer else folder
        if entry.heads:
            heads = _fetch_source(entry.heads, label, on_progress)
        else:
            heads = folder if entry.head_format == "full-checkpoint" else None
        eagle = _fetch_source(entry.eagle, label, on_progress) if entry.eagle else None
        return ModelSpec(name, folder, tokenizer, heads, _template(entry.chat_template), entry.tree, eagle)
    local = Path(name).expanduser()
    if (local / "config.json").is_file():
        return ModelSpec(name, local, local, None, None, "cpu-16")
    if local.exists() or not _is_repo_id(name):
        raise UserError(
            f"Unknown model '{name}'; use a catalog id (see `medusa-chat models`), a hub repo id such as "
            "org/name, a .gguf file, or a folder with config.json and weights."
        )
    folder = hub.fetch(name, patterns=BACKBONE_FILES, on_progress=on_progress, weights=True)
    return ModelSpec(name, folder, folder, None, None, "cpu-16")


def _fetch_source(source: catalog.Source, label: str, on_progress, weights: bool = False) -> Path:
    return hub.fetch(
        source.repo,
        source.revision,
        list(source.patterns),
        label=label,
        on_progress=on_progress,
        weights=weights,
    )


def _is_repo_id(name: str) -> bool:
    """ "org/name" as the hub spells it; anything else (a path like /x or ./x) is a folder."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", name) is not None and ".." not in name


def resolve_heads(name: str, on_progress=None) -> Path:
    """--heads: a local folder or a hub repo id."""
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if local.exists() or not _is_repo_id(name):
        raise UserError(f"No heads folder '{name}'; pass a folder with Medusa heads or a hub repo id (org/name).")
    return hub.fetch(name, patterns=HEAD_FILES, on_progress=on_progress)


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu.")
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None and device.index >= (count := torch.cuda.device_count()):
        raise UserError(
            f"--device {name} was asked for but {count} CUDA GPU(s) are visible; use cuda:0 to cuda:{count - 1}."
        )
    return device


def device_map(device: torch.device) -> dict[str, str]:
    """Everything on `device`, as `from_pretrained` takes it for quantized loads (which place the
    weights themselves, and left alone put them on the current GPU whatever --device says)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return {"": str(device)}


def pick_dtype(name: str, device: torch.device, config: object | None = None) -> torch.dtype:
    """`auto`: the fastest dtype here. On a GPU bf16 (fp16 where bf16 is emulated); on a CPU
    the dtype of the fastest kernel measured on this machine (`core.measure.kernels`)."""
    if name != "auto":
        if name not in DTYPES:
            raise UserError(f"Unknown dtype '{name}'; choose auto, {', '.join(DTYPES)}.")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return DTYPES[cpu_choice(config, None, False).dtype]


def _record() -> Path:
    """Where this machine's kernel measurements are remembered."""
    return cache_dir() / "cpu-kernels.json"


def cpu_choice(config: object | None, dtype: str | None, int4: bool) -> kernels.Choice:
    """The dtype and matmul kernels to run `config`'s model with on this CPU (measured once)."""
    hidden = getattr(config, "hidden_size", 1024)
    inner = getattr(config, "intermediate_size", 4 * hidden)
    record = _record()
    cpu_attention.use_measured(config, int4, record)  # keys and values' bits, then the attention kernel
    if int4:  # the 4-bit kernels' flavors first: the kernels are then timed as they will run
        q4.use_amx(kernels.amx_rows(hidden, inner, record))
        q4.use_avx_vnni(kernels.avx_vnni(hidden, inner, record))
        kernels.prefetch_l2(hidden, inner, record)  # sets the library's prefetches as measured
    return kernels.choose(hidden, inner, dtype, int4, record)


def load_backbone(
    name: str = EMBEDDED_ID,
    dtype: str = "auto",
    device: str = "auto",
    quantization: str = "auto",
    spec: ModelSpec | None = None,
    on_progress=None,
) -> Backbone:
    spec = spec or resolve(name, on_progress)
    dev = pick_device(device)
    try:
        config = light.read_config(spec.folder, gguf=spec.gguf is not None)
    except (OSError, ValueError) as e:
        raise UserError(f"The model in {spec.folder} has an unreadable config.json ({e}).") from e
    quant = pick_quantization(quantization, dev, config, dtype)
    if dtype != "auto":
        pick_dtype(dtype, dev)  # an unknown name is refused before anything loads
    choice = None
    if dev.type == "cpu" and quant == "int4":
        q4.prepare()  # its kernel compiles (first launch) or loads while the weights load
    if dev.type == "cpu" and quant in ("none", "int4") and lean.servable(config):
        choice = cpu_choice(config.get_text_config(), None if dtype == "auto" else dtype, quant == "int4")
        if quant == "int4" and dtype not in ("auto", choice.dtype):
            print(f"note: int4 runs with {choice.dtype} activations; --dtype {dtype} is not used.", file=sys.stderr)
        torch_dtype = DTYPES[choice.dtype]
    elif quant == "int4":
        raise UserError(f"--quantization int4 runs Llama-family models only, not {config.model_type}; use none.")
    else:
        torch_dtype = pick_dtype(dtype, dev, config.get_text_config())
    options = {"dtype": torch_dtype}
    if quant in ("nf4", "int8"):
        options["quantization_config"] = bnb_config(quant, torch_dtype, dev)
    if quant in ("nf4", "int8", "pre-quantized"):
        options["device_map"] = device_map(dev)
    if quant != "pre-quantized":
        head = choice.head_kernel if choice is not None else None
        label = {"nf4": "4-bit nf4", "int8": "8-bit", "int4": "4-bit int4"}.get(
            quant, str(torch_dtype).removeprefix("torch.")
        )
        print(
            f"Loading {spec.name} ({label}): about {estimate_gb(config, torch_dtype, quant, head):.1f} GB of memory.",
            file=sys.stderr,
        )
    try:
        # the tokenizer first: its working memory while it loads (~0.5 GB for a 262k vocabulary) is
        # given back before the weights come in, not added to them
        tokenizer = load_tokenizer(spec)
        heap.give_back()
        model = _load_model(spec, config, options, quant, dev, choice)
    except torch.OutOfMemoryError as e:
        raise UserError(f"Out of GPU memory loading {spec.name}; choose a smaller model or --quantization nf4.") from e
    except (OSError, ValueError, ImportError) as e:
        raise UserError(f"Could not load the model in {spec.folder} ({e}).") from e
    eos = _eos_ids(model, tokenizer)
    backend = _backend(model, choice, quant)
    if quant == "int4" and backend is not None:  # 8-bit keys and values only where they keep its answers
        rebuild = functools.partial(_backend, model, choice, quant)
        backend = kv_choice.faithful(backend, config.get_text_config(), tokenizer, spec.folder, _record(), rebuild)
    return Backbone(spec.name, model, tokenizer, eos, spec.chat_template, spec.folder, backend, spec.gguf)


def load_tokenizer(spec: ModelSpec):
    """The model's tokenizer (a GGUF file's as its description serialized it)."""
    from transformers import AutoTokenizer

    if spec.gguf is not None and (Path(spec.tokenizer_folder) / "tokenizer.json").is_file():
        return gguf_tokenizer.described_tokenizer(Path(spec.tokenizer_folder))
    return AutoTokenizer.from_pretrained(spec.tokenizer_folder)


def _backend(model: PreTrainedModel, choice: kernels.Choice | None, quant: str) -> Backend | None:
    """The lean forward with the kernels measured on this machine where `choice` is one (None:
    transformers' own forward, its linear layers transposed in float32 on the CPU)."""
    if choice is not None:
        record = _record()  # the lm_head's by-node choice is remembered with the kernels'
        with heap.large_blocks_apart():
            return lean.accelerate(model, choice.kernel, choice.head_kernel, lambda h: kernels.head_by_row(h, record))
    if model.device.type == "cpu" and model.dtype == torch.float32 and quant == "none":
        transpose_linears(model)  # bf16 is the other way round: transposed weights are far slower
    return None


def _load_model(
    spec: ModelSpec, config: object, options: dict, quant: str, dev: torch.device, choice: kernels.Choice | None
) -> PreTrainedModel:
    """The model: in int4 on the lean forward, read a tensor at a time into its packed layers
    (`models.direct`: never the whole model in full precision); else through `from_pretrained`
    (a GGUF file converted first)."""
    if choice is not None and quant == "int4":
        with heap.large_blocks_apart():
            model = direct.packed_model(
                config, options["dtype"], choice.kernel, choice.head_kernel, spec.gguf, spec.folder
            )
        if model is not None:
            return model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_files.with_weights(spec.folder, spec.gguf), **options)
    return (model if quant in ("nf4", "int8", "pre-quantized") else model.to(dev)).eval()


def _eos_ids(model: PreTrainedModel, tokenizer: object) -> tuple[int, ...]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def shipped_heads_dir(model_id: str) -> Path | None:
    folder = Path(str(resources.files("assets") / "heads" / model_id))
    return folder if (folder / "medusa_lm_head.safetensors").is_file() else None


def corpus_for(backbone: Backbone) -> Corpus | None:
    """The index of the model's own past replies that ships with it, for retrieval drafting (None
    if none ships; one sentence on stderr, and None, if the file cannot be used)."""
    file = Path(str(resources.files("assets") / "retrieval" / f"{backbone.name}.safetensors"))
    if not re.fullmatch(r"[\w.-]+", backbone.name) or not file.is_file():  # catalog ids only, not paths
        return None
    try:
        return load_corpus(file, backbone.model.get_output_embeddings().out_features)
    except UserError as e:
        print(f"{e} Drafting goes on without it.", file=sys.stderr)
        return None


def shipped_eagle(model_id: str) -> Path | None:
    file = Path(str(resources.files("assets") / "eagle" / f"{model_id}.safetensors"))
    return file if file.is_file() else None


def resolve_eagle(name: str, on_progress=None) -> Path:
    """--eagle: a drafter file from `train-drafter`, or an EAGLE-1/2 checkpoint's folder or hub repo id."""
    local = Path(name).expanduser()
    if local.is_file() or local.is_dir():
        return local
    if local.exists() or not _is_repo_id(name):
        raise UserError(
            f"No EAGLE drafter '{name}'; pass a .safetensors file from `train-drafter --kind eagle`, "
            "or an EAGLE checkpoint's folder or hub repo id (org/name)."
        )
    return hub.fetch(name, patterns=EAGLE_FILES, on_progress=on_progress)


def eagle_for(backbone: Backbone, path: Path | None) -> EagleDraft | None:
    """The EAGLE draft layer at `path` (a drafter file, or a published checkpoint's folder); None
    without one. One UserError sentence if it cannot be used for this model."""
    if path is None:
        return None
    if path.is_file():
        return load_draft(path, backbone.model, backbone.name)[0]
    return load_published(path, backbone.model)


def heads_for(backbone: Backbone, heads_dir: str | Path | None, num_heads: int = 4) -> tuple[MedusaHeads, bool]:
    """The heads to draft with and whether they are trained.

    Without a folder (neither --heads nor the model's default), untrained heads
    (`MedusaHeads.untrained`: Medusa's identity init, each head the shared lm_head), which keep
    decoding correct but rarely have a draft accepted.
    """
    lm_head = backbone.model.get_output_embeddings()
    if heads_dir:
        heads, trained = load_heads(heads_dir, lm_head, backbone.name), True
    else:
        heads, trained = MedusaHeads.untrained(lm_head, num_heads), False
    if backbone.backend.layer_kernel is not None and heads.num_layers:  # the lean CPU forward: draft with this
        # CPU's fastest kernel (heads without blocks draft through the lm_head: nothing to pack or time)
        width = heads.vocab_size if heads.token_ids is None else len(heads.token_ids)
        dtype, kernel = kernels.drafting(width, heads.hidden_size, heads.num_heads, _record())
        heads.pack(kernel, kernels.DTYPES[dtype])
    return heads, trained


def step_costs(backbone: Backbone, heads: MedusaHeads | None) -> costs.StepCosts:
    """This machine's step-cost curve for the loaded model, remembered from an earlier launch
    (`needed` if not: the caller measures it when the model is idle)."""
    key = costs.curve_key(backbone.backend, heads.drafting if heads is not None else None)
    return costs.StepCosts(backbone.backend, heads, costs.CurveStore(cache_dir() / "step-costs"), key)
