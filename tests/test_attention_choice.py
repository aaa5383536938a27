"""The attention kernels a GPU's steps run with: measured at growing lengths, kept by a clear margin,
applied to every step (drafting, verify, commit), remembered with the step-cost curve.

The GPU is the virtual one of `tests.virtual_device` (the CPU pretending to be cuda:0), with a
clock that charges each timed step what the kernels in force would cost on a Hopper GPU.
"""

from __future__ import annotations

import torch

from core.backends.torch import TorchBackend
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.drafters.base import Draft, Drafter
from core.drafters.policy import CostCurve
from core.measure import attention
from core.measure.costs import CurveStore, StepCosts
from tests.helpers import tiny_model
from tests.virtual_device import GPU, VirtualCuda, place


class Clock:
    """`now` for the measurement: every reading after a start adds what one step costs under the
    kernels the backend runs with right then."""

    def __init__(self, backend, cost_ms: dict[str, float]) -> None:
        self.backend, self.cost_ms, self.t, self.readings = backend, cost_ms, 0.0, 0

    def __call__(self, device=None) -> float:
        self.readings += 1
        if self.readings % 2 == 0:  # the end of a timed step
            self.t += self.cost_ms[self.backend.attention] / 1000
        return self.t


def virtual_backend() -> TorchBackend:
    return TorchBackend(place(tiny_model("llama")))


def test_a_cpu_measures_nothing_and_keeps_pytorchs_choice(monkeypatch):
    backend = TorchBackend(tiny_model("llama"))
    monkeypatch.setattr(attention, "now", lambda device=None: (_ for _ in ()).throw(AssertionError("timed")))
    assert attention.choose(backend) == "default"


def test_on_a_gpu_the_clearly_faster_kernels_are_kept(monkeypatch):
    backend = virtual_backend()
    with VirtualCuda():
        assert backend.device == GPU
        monkeypatch.setattr(attention, "now", Clock(backend, {"default": 56.0, "no-cudnn": 22.0}))
        assert attention.choose(backend) == "no-cudnn"
        monkeypatch.setattr(attention, "now", Clock(backend, {"default": 20.0, "no-cudnn": 19.0}))
        assert attention.choose(backend) == "default"  # within the margin: PyTorch's own choice stays
        monkeypatch.setattr(attention, "now", Clock(backend, {"default": 20.0, "no-cudnn": 40.0}))
        assert attention.choose(backend) == "default"
    assert backend.attention == "default"  # measuring leaves the backend as it was


def test_each_timed_step_is_a_new_length(monkeypatch):
    """cuDNN's plan cost shows only on new shapes: the steps must not re-run one length."""
    backend = TorchBackend(tiny_model("llama"))
    lengths = []
    real = attention.verify
    monkeypatch.setattr(
        attention, "verify", lambda b, cache, draft: lengths.append(b.length(cache)) or real(b, cache, draft)
    )
    attention._median_step_ms(backend, "no-cudnn", nodes=4, steps=5)
    assert len(lengths) == 6 and len(set(lengths)) == 6


class Spy(Drafter):
    """Plain drafting that records whether cuDNN attention was allowed while it drafted."""

    def __init__(self, device) -> None:
        self.device, self.cudnn = device, []

    def propose(self, hidden, root, history=()) -> Draft:
        from core.drafters.base import NoDrafter

        self.cudnn.append(torch.backends.cuda.cudnn_sdp_enabled())
        return NoDrafter(self.device).propose(hidden, root)


def test_every_step_runs_under_the_chosen_kernels_and_replies_are_unchanged():
    backend = TorchBackend(tiny_model("llama"))
    settings = DecodeSettings(max_new_tokens=8)
    replies = {}
    for choice in ("default", "no-cudnn"):
        backend.attention = choice
        spy = Spy(backend.device)
        replies[choice] = collect(stream(backend, [1, 5, 9, 2], settings, spy))[1].token_ids
        assert spy.cudnn and all(allowed == (choice == "default") for allowed in spy.cudnn)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each step
    assert replies["default"] == replies["no-cudnn"]


def test_the_choice_is_remembered_with_the_curve(tmp_path):
    store = CurveStore(tmp_path)
    store.save("k", CostCurve({1: 20.0, 8: 24.0}, 0.0), "no-cudnn")
    gpu = virtual_backend()
    with VirtualCuda():
        costs_ = StepCosts(gpu, None, store, "k", say=lambda s: None)
        assert not costs_.needed and gpu.attention == "no-cudnn"
        store.save("old", CostCurve({1: 20.0, 8: 24.0}, 0.0))
        store.path("old").write_text(store.path("old").read_text().replace('"attention"', '"other"'))
        assert StepCosts(gpu, None, store, "old", say=lambda s: None).needed  # a GPU curve without a choice
    cpu = TorchBackend(tiny_model("llama"))
    assert not StepCosts(cpu, None, store, "old", say=lambda s: None).needed and cpu.attention == "default"
