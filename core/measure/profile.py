"""What one decode step costs on this machine, by tree size, split into its parts.

The parts are the step's own functions, timed one by one on a real context: drafting (the
heads filling a tree of that size), the attention mask, the backbone's embedding and decoder
layers, the lm_head over every node, the acceptance rule and the cache commit. `total_ms` is
the whole step timed end to end, so the parts can be checked against it. The machine it ran
on (CPU model, the instruction sets the kernels may use, threads, torch version) comes along:
these figures are only true there.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from core.backends.base import Backend
from core.backends.lean.packed import QUANTIZED, PackedLinear
from core.cpuinfo import cpu_fields, cpu_flags
from core.decode.settings import DecodeSettings
from core.decode.step import Forward, accept, commit, decoder_layers, prefill, tree_mask, verify
from core.decode.tree import TreeBuffers, build_tree, load_tree
from core.drafters.base import Draft, Drafter, NoDrafter
from core.measure.clock import synchronizer, time_ms

SIZES = (1, 2, 4, 8, 16, 32, 64)  # nodes per verify forward, the root included
KERNEL_LIMITS = (("oneDNN", "ONEDNN_MAX_CPU_ISA"), ("MKL", "MKL_ENABLE_INSTRUCTIONS"))
SHAPE = "mc_sim_7b_63"  # trees of n nodes are the first n - 1 paths of this preset (parents come first)


@dataclass(frozen=True)
class Machine:
    cpu: str  # CPU model name
    isa: str  # the best instruction set the CPU reports: AVX2, AVX-512, AVX512-BF16 or AMX
    kernels: str  # what torch's own kernels dispatch to here (ATEN_CPU_CAPABILITY can lower it)
    threads: int
    torch: str
    device: str  # "cpu" or the GPU's name

    @property
    def key(self) -> str:
        """One string that changes whenever a measurement could."""
        return "|".join(str(v) for v in asdict(self).values())


@dataclass(frozen=True)
class StepCost:
    nodes: int
    total_ms: float  # the whole step: propose → verify → accept → commit
    draft_ms: float
    mask_ms: float
    layers_ms: float  # embedding + decoder layers + final norm
    lm_head_ms: float
    accept_ms: float
    commit_ms: float


@dataclass(frozen=True)
class RowFloor:
    """What one more tree row costs against what its arithmetic needs at least."""

    macs: float  # multiply-adds of one row through every linear layer (decoder layers and lm_head)
    peak_gmacs: float  # the layers' kernel's measured peak, G multiply-adds a second (many rows, weights in cache)
    floor_ms: float  # macs ÷ peak: one more row can cost no less on this machine
    measured_ms: dict[int, float]  # per tree size n > 1: (step(n) − step(1)) / (n − 1)


def machine(device: torch.device) -> Machine:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return Machine(_cpu_name(), _cpu_isa(), "cuda", torch.get_num_threads(), torch.__version__, name)
    return Machine(_cpu_name(), _cpu_isa(), cpu_kernels(), torch.get_num_threads(), torch.__version__, "cpu")


def cpu_kernels() -> str:
    """The instruction set torch's kernels use here, with any limit set on oneDNN or MKL
    (the three variables that make an AVX-512 CPU run as an AVX2-only one)."""
    limits = [f"{lib} {os.environ[var]}" for lib, var in KERNEL_LIMITS if os.environ.get(var)]
    aten = torch.backends.cpu.get_cpu_capability()
    return f"{aten} ({', '.join(limits)})" if limits else aten


def _cpu_name() -> str:
    return cpu_fields().get("model name") or platform.processor() or platform.machine()


def _cpu_isa() -> str:
    flags = cpu_flags()
    for name, flag in (("AMX", "amx_bf16"), ("AVX512-BF16", "avx512_bf16"), ("AVX-512", "avx512f"), ("AVX2", "avx2")):
        if flag in flags:
            return name
    return platform.machine()


def shaped_tree(nodes: int) -> TreeBuffers:
    """A tree of `nodes` nodes in the shape the presets use (wide near the root)."""
    paths = load_tree(SHAPE)[1].paths
    if nodes - 1 > len(paths):
        raise ValueError(f"at most {len(paths) + 1} nodes")
    return build_tree(list(paths[: nodes - 1]))


def step_costs(
    backend: Backend,
    context: list[int],
    drafter_for: Callable[[TreeBuffers], Drafter] | None = None,
    sizes: tuple[int, ...] = SIZES,
    repeats: int = 5,
    on_size: Callable[[int], None] = lambda n: None,
) -> list[StepCost]:
    """The cost of one step after `context`, for each tree size. `drafter_for(tree)` builds the
    drafter whose proposal is timed (None: the tree's tokens are given, drafting costs 0)."""
    device = backend.device
    sync = synchronizer(device)
    settings = DecodeSettings()
    cache = backend.new_cache()
    with torch.inference_mode():
        fwd = prefill(backend, cache, torch.tensor(context, device=device))
    past = backend.length(cache)
    hidden, root = fwd.hidden[-1], torch.tensor(context[-1], device=device)
    out = []
    for n in sizes:
        on_size(n)
        tree = shaped_tree(n).to(device)
        drafter = drafter_for(tree) if drafter_for and n > 1 else None
        tokens = torch.tensor((context * (n // len(context) + 1))[:n], device=device)  # real tokens
        draft = Draft(tokens, tree) if n > 1 else NoDrafter(device).propose(hidden, root)
        parts = _parts(backend, cache, past, draft, settings, repeats, sync)

        def whole(draft=draft, drafter=drafter) -> None:
            with torch.inference_mode():
                d = drafter.propose(hidden, root, context) if drafter else draft
                if d.tree.size != draft.tree.size:  # a drafter may graft more nodes: keep the size
                    d = draft
                commit(backend, cache, past, accept(verify(backend, cache, d), d, settings, None))
                backend.truncate(cache, past)

        draft_ms = time_ms(lambda d=drafter: d.propose(hidden, root, context), repeats, sync) if drafter else 0.0
        out.append(StepCost(n, time_ms(whole, repeats, sync), draft_ms, **parts))
    return out


def _parts(
    backend: Backend, cache, past: int, draft: Draft, settings: DecodeSettings, repeats: int, sync
) -> dict[str, float]:
    """Each part of verify → accept → commit timed alone (the cache is cut back after each)."""
    tree = draft.tree
    with torch.inference_mode():
        mask = tree_mask(backend, draft, past)
        hidden = decoder_layers(backend, cache, draft, mask, past)[0]
        backend.truncate(cache, past)
        fwd = Forward(backend.logits(hidden), hidden)
        result = accept(fwd, draft, settings, None)

        def layers() -> None:
            decoder_layers(backend, cache, draft, mask, past)
            backend.truncate(cache, past)

        def commit_only() -> None:
            decoder_layers(backend, cache, draft, mask, past)
            commit(backend, cache, past, result)
            backend.truncate(cache, past)

        timed = {
            "mask_ms": time_ms(lambda: tree_mask(backend, draft, past), repeats, sync) if tree.size > 1 else 0.0,
            "layers_ms": time_ms(layers, repeats, sync),
            "lm_head_ms": time_ms(lambda: backend.logits(hidden), repeats, sync),
            "accept_ms": time_ms(lambda: accept(fwd, draft, settings, None), repeats, sync),
        }
        timed["commit_ms"] = max(time_ms(commit_only, repeats, sync) - timed["layers_ms"], 0.0)
    return timed


def row_macs(model) -> int:
    """Multiply-adds of one row through the model's linear layers (packed or not), the lm_head included."""
    return sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))
    )


def kernel_peak(backend: Backend, rows: int = 32, outputs: int = 2048, repeats: int = 7) -> float:
    """The decoder layers' matmul kernel's multiply-adds a second here (G), at `rows` rows on a
    weight of the model's width that stays in the CPU cache: the most a tree's rows can get."""
    model = backend.model
    hidden = model.config.get_text_config().hidden_size
    kernel = backend.layer_kernel or "dense"
    dtype = torch.bfloat16 if kernel in QUANTIZED else model.dtype
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(outputs, hidden, generator=gen) * 0.05).to(dtype)
    layer = PackedLinear(weight, None, kernel).to(model.device)
    x = torch.randn(rows, hidden, generator=gen).to(dtype=dtype, device=model.device)
    calls = 10
    sync = synchronizer(model.device)

    def run() -> None:
        for _ in range(calls):
            layer(x)

    with torch.inference_mode():
        ms = time_ms(run, repeats, sync, fastest=True)
    return outputs * hidden * rows * calls / ms / 1e6


def row_floor(backend: Backend, costs: list[StepCost]) -> RowFloor:
    """One more row's measured cost at each size against its arithmetic floor (`RowFloor`)."""
    macs, peak = row_macs(backend.model), kernel_peak(backend)
    one = costs[0]
    measured = {c.nodes: (c.total_ms - one.total_ms) / (c.nodes - one.nodes) for c in costs if c.nodes > one.nodes}
    return RowFloor(macs, peak, macs / peak / 1e6, measured)


def floor_line(floor: RowFloor) -> str:
    """The floor as one line under the table."""
    measured = ", ".join(f"{ms:.2f} ms (to {n})" for n, ms in floor.measured_ms.items()) or "not measured"
    return (
        f"one more row: {measured}; floor {floor.floor_ms:.2f} ms ({floor.macs / 1e9:.2f} G multiply-adds at the "
        f"kernel's {floor.peak_gmacs:.0f} G/s peak)"
    )


def table(costs: list[StepCost]) -> str:
    """The figures as a text table, with each size's cost relative to a one-node step."""
    one = costs[0].total_ms
    head = f"{'nodes':>5} {'step ms':>8} {'× 1':>6} {'draft':>7} {'mask':>6} {'layers':>7} {'lm_head':>8} "
    head += f"{'accept':>7} {'commit':>7}"
    rows = [
        f"{c.nodes:>5} {c.total_ms:>8.2f} {c.total_ms / one:>6.2f} {c.draft_ms:>7.2f} {c.mask_ms:>6.2f} "
        f"{c.layers_ms:>7.2f} {c.lm_head_ms:>8.2f} {c.accept_ms:>7.2f} {c.commit_ms:>7.2f}"
        for c in costs
    ]
    return "\n".join([head, *rows])
