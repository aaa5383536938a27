"""What the chat's status line tells the user about the loaded model."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def _loaded(backend):
    """What the engine holds for a model served by `backend` (no heads, no drafters)."""
    from app.engine import Loaded

    return Loaded(SimpleNamespace(model=backend.model, backend=backend), None, True, "cpu-8", None)


def test_the_status_says_when_lossless_is_exact_only_up_to_rounding():
    from app.engine import Engine
    from core.backends import lean as fast
    from core.backends.torch import TorchBackend
    from tests.helpers import library_builds, tiny_backend

    engine = Engine("tiny")
    for dtype, said in ((torch.float32, False), (torch.bfloat16, True)):
        model = SimpleNamespace(dtype=dtype, device=torch.device("cpu"), config=SimpleNamespace())
        engine.loaded = _loaded(TorchBackend(model))
        assert ("exact up to bfloat16 rounding" in engine.status()) is said
    if fast.kernel_works("q4", torch.bfloat16) or library_builds():  # the library's decoder rounds rows alike
        engine.loaded = _loaded(tiny_backend("llama+q4"))
        assert "exact up to" not in engine.status() and "4-bit weights, bfloat16" in engine.status()


def test_the_status_names_4_bit_weights():
    import pytest

    from app.engine import Engine
    from core.backends import lean as fast
    from tests.helpers import tiny_backend

    if not fast.kernel_works("int4", torch.bfloat16):
        pytest.skip("no int4 kernel here")

    engine = Engine("tiny")
    engine.loaded = _loaded(tiny_backend("llama+int4"))
    assert "4-bit weights, bfloat16 on cpu" in engine.status()
    engine.loaded = _loaded(tiny_backend("llama"))
    assert "4-bit" not in engine.status()
