"""A GGUF file's model built without transformers' model code (`models.light`): module for module
the model transformers' classes build, the same rotary tables, embedding scale and logits, family
by family; the configs it does not build keep transformers' classes; and loading a GGUF file
imports none of transformers' model code (~110 MB and ~2.5 s a launch)."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from core.backends import lean
from core.backends.lean.rope import Rope, takes_kinds
from core.decode.step import prefill
from core.train import runnable
from models import direct, light, loader
from models.embedded import embedded_described
from tests.helpers import _tiny, require_kernel
from tests.test_lean_families import tiny

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3", "mistral", "llama3-rope")
PROMPT = [1, 17, 33, 5, 60, 2, 41, 9, 70, 12, 3, 88, 45, 6, 30, 31, 50]


def _model(family: str):
    if family in ("llama", "qwen2"):
        return _tiny(family, 96, 0)
    if family == "llama3-rope":  # Llama 3.1/3.2's rotary table
        rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config = LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rope_parameters=rope, initializer_range=0.1,
        )  # fmt: skip
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()
    return tiny(family)


@pytest.fixture(scope="module", params=FAMILIES)
def folder(request, tmp_path_factory):
    """A random model of the family saved as a folder (its config.json as a GGUF description's: whole)."""
    path = tmp_path_factory.mktemp(request.param)
    _model(request.param).save_pretrained(path)
    return path


def test_the_model_is_transformers_module_for_module(folder):
    """The same parameters (names, shapes, dtypes), rotary tables for every kind of layer and
    embedding scale as transformers' skeleton of the same config."""
    config = light.config_of(folder)
    assert isinstance(config, light.LightConfig)
    ours = light.skeleton(config, torch.bfloat16, folder)
    theirs = light.skeleton(AutoConfig.from_pretrained(folder), torch.bfloat16)
    assert isinstance(ours, light.CausalLM) and not isinstance(theirs, light.CausalLM)

    def params(model):
        return [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)]

    assert params(ours) == params(theirs)
    a, b = ours.base_model.rotary_emb, theirs.base_model.rotary_emb
    assert takes_kinds(a) == takes_kinds(b)
    kinds = sorted(set(config.layer_types)) if takes_kinds(b) else [None]
    positions, dim = torch.tensor([0, 1, 7, 100, 300, 511]), lean.layer.head_size(config)
    for kind in kinds:
        tables = [Rope(rotary, dim, torch.bfloat16, kind)(positions) for rotary in (a, b)]
        assert all(torch.equal(got, want) for got, want in zip(*tables, strict=True))
    scale = getattr(theirs.get_input_embeddings(), "embed_scale", None)
    if scale is not None:
        assert torch.equal(ours.get_input_embeddings().embed_scale, scale)
    assert [lean.layer.unit_offset(m) for m in ours.modules() if hasattr(m, "variance_epsilon")] == [
        lean.layer.unit_offset(m) for m in theirs.modules() if "RMSNorm" in type(m).__name__
    ]


def test_the_model_computes_what_transformers_model_computes(folder):
    """Read from the same file into the library's layers: the same logits, bit for bit."""
    require_kernel("q4", torch.bfloat16)
    logits = []
    for config in (light.config_of(folder), AutoConfig.from_pretrained(folder)):
        model = direct.packed_model(config, torch.bfloat16, "q4", "q8", None, folder)
        backend = lean.accelerate(model, "q4", "q8", by_row=lambda head: False)
        with torch.inference_mode():
            features = prefill(backend, backend.new_cache(), torch.tensor(PROMPT)).features
            logits.append(backend.logits(features).full())
    assert torch.equal(*logits)


def test_training_runs_transformers_forward_on_the_models_own_modules(folder):
    """What training and calibration read (`core.train.runnable`: transformers' forward over the
    model's packed modules) equals that forward on the model transformers' classes built."""
    require_kernel("q4", torch.bfloat16)
    states = []
    for config in (light.config_of(folder), AutoConfig.from_pretrained(folder)):
        model = direct.packed_model(config, torch.bfloat16, "q4", "q8", None, folder)
        lean.accelerate(model, "q4", "q8", by_row=lambda head: False)
        with torch.inference_mode():
            out = runnable(model).base_model(input_ids=torch.tensor([PROMPT]), output_hidden_states=True)
        states.append(torch.stack(out.hidden_states))
    assert runnable(model) is model and torch.equal(*states)


def test_configs_it_does_not_build_keep_transformers_classes(tmp_path):
    """Another family, a rotary table that changes with the length, a config that leaves out a
    value its modules read: no light config (the load takes transformers' classes)."""
    _tiny("llama", 96, 0).save_pretrained(tmp_path)
    good = json.loads((tmp_path / "config.json").read_text())
    assert light.config_of(tmp_path) is not None
    changes = [
        {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]},
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
        {"quantization_config": {"quant_method": "bitsandbytes"}},
    ]
    for change in [*changes, "rms_norm_eps"]:
        values = {k: v for k, v in good.items() if k != change} if isinstance(change, str) else good | change
        (tmp_path / "config.json").write_text(json.dumps(values))
        assert light.config_of(tmp_path) is None, change
    (tmp_path / "config.json").write_text("{not json")
    assert light.config_of(tmp_path) is None


LOAD = """
import sys, torch
from models import loader
backbone = loader.load_backbone(sys.argv[1], spec=loader.resolve(sys.argv[1]), device="cpu", quantization="int4")
from core.decode.step import prefill
ids, backend = torch.tensor(backbone.encode_chat("Hi.")), backbone.backend
with torch.inference_mode():
    features = prefill(backend, backend.new_cache(), ids).features
    assert backend.logits(features).full().isfinite().all()
print(type(backbone.model).__name__, "transformers.modeling_utils" in sys.modules, "sympy" in sys.modules)
"""


def test_loading_a_gguf_file_imports_no_model_code():
    """The embedded file given by its path loads, in a fresh process, without transformers' model
    code (nor sympy, which it imports): its description was written once already."""
    _, gguf = embedded_described()
    loader.resolve(str(gguf))  # its description written here (transformers' GGUF reader reads it once)
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(gguf)], capture_output=True, text=True, timeout=900, check=True
    )
    assert done.stdout.split()[-3:] == ["CausalLM", "False", "False"], done.stderr[-2000:]
