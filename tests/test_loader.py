import pytest
import torch

from core.errors import UserError
from models.cpu import TransposedLinear, transpose_linears
from models.loader import pick_dtype, resolve, resolve_heads
from tests.helpers import tiny_model


def test_transposed_linears_compute_the_same_logits():
    model = tiny_model("qwen2")  # q/k/v projections carry biases
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = model(ids).logits
        transpose_linears(model)
        after = model(ids).logits
    assert isinstance(model.lm_head, TransposedLinear)
    assert model.lm_head.weight.shape == (96, 64)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_dtype_names():
    cpu = torch.device("cpu")
    assert pick_dtype("float32", cpu) is torch.float32
    assert pick_dtype("bfloat16", cpu) is torch.bfloat16
    assert pick_dtype("auto", cpu) in (torch.float32, torch.bfloat16)
    with pytest.raises(UserError, match="Unknown dtype 'int3'"):
        pick_dtype("int3", cpu)


def test_unknown_model_is_refused(tmp_path):
    with pytest.raises(UserError, match="Unknown model"):
        resolve(str(tmp_path))  # a folder without config.json
    with pytest.raises(UserError, match="Unknown model 'not-a-model'"):
        resolve("not-a-model")
    with pytest.raises(UserError, match="Unknown model '/not-a-model'"):
        resolve("/not-a-model")  # a path, not a hub repo id, although it has one slash


def test_heads_paths_are_not_taken_for_hub_repos():
    for path in ("/nope", "./nope", "nope", "~/nope"):
        with pytest.raises(UserError, match="No heads folder"):
            resolve_heads(path)


def test_cpu_kernel_choice_is_kept_per_kernel_set_and_survives_a_damaged_record(tmp_path, monkeypatch):
    import json

    from models import loader

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = type("Config", (), {"hidden_size": 64, "intermediate_size": 128})()
    record = loader.cache_dir() / "cpu-kernels.json"
    record.parent.mkdir(parents=True)
    for damaged in ("[1, 2]", "not json", '{"x": 3}'):
        record.write_text(damaged)
        assert loader.cpu_choice(config, None, False).dtype in ("float32", "bfloat16")
    (key,) = json.loads(record.read_text()).keys() - {"x"}
    assert torch.backends.cpu.get_cpu_capability() in key and "64x128" in key
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # other kernels: measured again, kept apart
    loader.cpu_choice(config, None, False)
    assert len(json.loads(record.read_text())) == 3 and "oneDNN AVX2" in str(json.loads(record.read_text()))
