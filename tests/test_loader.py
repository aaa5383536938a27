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
