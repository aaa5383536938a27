"""What the chat's status line tells the user about the loaded model."""

from __future__ import annotations

import torch


def test_the_status_says_when_lossless_is_exact_only_up_to_rounding():
    from types import SimpleNamespace

    from app.engine import Engine, Loaded
    from core.backends import lean as fast
    from tests.helpers import library_builds, tiny_model

    engine = Engine("tiny")
    for dtype, said in ((torch.float32, False), (torch.bfloat16, True)):
        backbone = SimpleNamespace(model=SimpleNamespace(dtype=dtype, device=torch.device("cpu")))
        engine.loaded = Loaded(backbone, None, True, "cpu-8", None)
        assert ("exact up to bfloat16 rounding" in engine.status()) is said
    if fast.kernel_works("q4", torch.bfloat16) or library_builds():  # the library's decoder rounds rows alike
        engine.loaded = Loaded(SimpleNamespace(model=tiny_model("llama+q4")), None, True, "cpu-8", None)
        assert "exact up to" not in engine.status() and "4-bit weights, bfloat16" in engine.status()


def test_the_status_names_4_bit_weights():
    from types import SimpleNamespace

    import pytest

    from app.engine import Engine, Loaded
    from core.backends import lean as fast
    from tests.helpers import tiny_model

    if not fast.kernel_works("int4", torch.bfloat16):
        pytest.skip("no int4 kernel here")

    engine = Engine("tiny")
    engine.loaded = Loaded(SimpleNamespace(model=tiny_model("llama+int4")), None, True, "cpu-8", None)
    assert "4-bit weights, bfloat16 on cpu" in engine.status()
    engine.loaded = Loaded(SimpleNamespace(model=tiny_model("llama")), None, True, "cpu-8", None)
    assert "4-bit" not in engine.status()
