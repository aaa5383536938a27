"""4- and 8-bit loads go where --device says: the CPU on a GPU host, the GPU named by cuda:N.

bitsandbytes (0.50 here) runs nf4 and int8 on the CPU too, so `--device cpu --quantization nf4`
loads on the CPU; without a device map transformers would put the weights on the current GPU.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import bitsandbytes  # noqa: F401  (imported while torch tells the truth about GPUs: some tests pretend)
import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.errors import UserError
from models.loader import device_map, load_backbone, pick_device
from tests.tiny_folder import save_tiny_model


class Stop(Exception):
    """Raised by the spy once it has seen what `from_pretrained` was asked for."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def spy_loads(monkeypatch, stop: bool = False) -> list[dict]:
    """Record every `from_pretrained` call's options (and with `stop`, load nothing)."""
    seen, original = [], AutoModelForCausalLM.from_pretrained

    def spy(folder, **options):
        seen.append(options)
        if stop:
            raise Stop
        return original(folder, **options)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    return seen


def gpu_host(monkeypatch, count: int = 1) -> None:
    """Pretend `count` GPUs are visible (nothing can be loaded onto them here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_device_map_names_the_asked_device():
    assert device_map(torch.device("cuda:1")) == {"": "cuda:1"}
    assert device_map(torch.device("cpu")) == {"": "cpu"}


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_quantized_loads_are_routed_to_the_named_gpu(tiny, monkeypatch, quantization):
    gpu_host(monkeypatch, count=2)
    seen = spy_loads(monkeypatch, stop=True)
    with pytest.raises(Stop):
        load_backbone(tiny.name, dtype="bfloat16", device="cuda:1", quantization=quantization, spec=tiny)
    assert seen[0]["device_map"] == {"": "cuda:1"}


def test_a_gpu_that_is_not_there_is_one_sentence(monkeypatch):
    gpu_host(monkeypatch, count=2)
    with pytest.raises(UserError, match=r"cuda:3 was asked for but 2 CUDA GPU\(s\) are visible") as e:
        pick_device("cuda:3")
    assert "\n" not in str(e.value)


def test_cpu_nf4_on_a_gpu_host_loads_and_decodes_on_the_cpu(tiny, monkeypatch):
    gpu_host(monkeypatch)  # left alone, transformers would put the 4-bit weights on cuda:0
    seen = spy_loads(monkeypatch)
    backbone = load_backbone(tiny.name, dtype="float32", device="cpu", quantization="nf4", spec=tiny)
    model = backbone.model
    assert seen[0]["device_map"] == {"": "cpu"}
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    monkeypatch.undo()  # decoding asks torch about the GPU too: the truth from here on
    _, done = collect(stream(backbone.backend, [5, 6, 7, 8], DecodeSettings(max_new_tokens=6)))
    assert len(done.token_ids) == 6 and done.exactness == "exact"  # plain decoding is the reference itself


def test_cpu_nf4_needs_a_bitsandbytes_that_runs_on_the_cpu(tiny, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes.backends.cpu" else real(name, *a),
    )
    with pytest.raises(UserError, match="runs nf4 on CUDA only; on the CPU use --quantization int4") as e:
        load_backbone(tiny.name, device="cpu", quantization="nf4", spec=tiny)
    assert "\n" not in str(e.value)


def test_the_stock_peer_of_a_4_bit_gpu_model_loads_in_its_setting_or_is_skipped(tiny, monkeypatch):
    from models import stock

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = SimpleNamespace(
        device=torch.device("cuda:0"), dtype=torch.bfloat16, config=SimpleNamespace(quantization_config=nf4)
    )
    backbone = SimpleNamespace(model=model, folder=tiny.folder)
    loads = []
    monkeypatch.setattr(
        stock, "load_stock", lambda b, dtype, same_quantization: loads.append((dtype, same_quantization)) or "copy"
    )
    wanted = {"hf": torch.float32, "hf-bf16": torch.bfloat16}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * 2**30, 80 * 2**30))
    peers, skipped = stock.stock_peers(backbone, wanted)
    assert peers == {"hf": "copy", "hf-bf16": "copy"} and skipped == []
    assert loads == [(torch.bfloat16, True)]  # one copy, in the backbone's own nf4 setting
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**28, 80 * 2**30))
    peers, skipped = stock.stock_peers(backbone, wanted)
    assert peers == {} and len(skipped) == 2
    assert all(s.startswith("The hf") and "GB of GPU memory" in s and "\n" not in s for s in skipped)


def test_the_stock_peer_of_a_cpu_model_is_one_full_copy_per_dtype(tiny):
    from models import stock

    backbone = load_backbone(tiny.name, dtype="float32", device="cpu", quantization="nf4", spec=tiny)
    peers, skipped = stock.stock_peers(backbone, {"hf": torch.float32, "hf-bf16": torch.bfloat16})
    assert skipped == [] and peers["hf"].dtype == torch.float32 and peers["hf-bf16"].dtype == torch.bfloat16
    assert not hasattr(peers["hf"].config, "quantization_config")  # the CPU's stock reference: full precision


@pytest.mark.parametrize("tied", [False, True])
def test_the_memory_printed_before_an_int4_load_is_what_the_packed_model_holds(tied):
    """The estimate against the bytes of every tensor the lean backend keeps: the int4 layout's
    4 bits and a float16 step and minimum per 32 inputs (in Q4_K's form where 256 divide them), the
    embedding and norms in bf16, and the lm_head's packed 8-bit copy beside the weight it keeps, or
    (tied) as the embedding's table too (0.56 bytes a weight and no copy: 20-29 % under at this shape)."""
    from transformers import LlamaConfig

    from core.backends import lean, q4
    from models.quantization import estimate_gb

    if q4.library() is None:
        pytest.skip(f"no kernel library here: {q4.unavailable()}")
    config = LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    lean.accelerate(model, "q4", "q8", by_row=lambda head: False)
    seen, held = set(), 0
    for module in model.modules():
        packed = getattr(module, "packed", None)
        tensors = [packed.w, packed.d, packed.m, packed.k6] if isinstance(packed, q4.Packed) else []
        tensors += [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        for t in tensors:
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                held += t.untyped_storage().nbytes()
    estimate = estimate_gb(config, torch.bfloat16, "int4", "q8") * 2**30
    assert abs(estimate - held) < 0.05 * held
