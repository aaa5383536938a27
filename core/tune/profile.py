"""What one decode step costs on this machine, by tree size, split into its parts.

The parts are the step's own functions, timed one by one on a real context: drafting (the
heads filling a tree of that size), the attention mask, the backbone's embedding and decoder
layers, the lm_head over every node, the acceptance rule and the cache commit. `total_ms` is
the whole step timed end to end, so the parts can be checked against it. The machine it ran
on (CPU model, the instruction sets the kernels may use, threads, torch version) comes along:
these figures are only true there.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from core import cache as kv
from core.clock import synchronizer
from core.settings import DecodeSettings
from core.step import (
    Draft,
    Drafter,
    Forward,
    NoDrafter,
    accept,
    commit,
    decoder_layers,
    prefill,
    project,
    tree_mask,
    verify,
)
from core.tree import TreeBuffers, build_tree, load_tree

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


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = (line.partition(":") for line in text.split("\n\n")[0].splitlines())
    return {k.strip(): v.strip() for k, _, v in fields}


def cpu_flags() -> set[str]:
    return set(_cpuinfo().get("flags", "").split())


def _cpu_name() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


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


def time_ms(
    fn: Callable[[], object], repeats: int = 5, sync: Callable[[], None] = lambda: None, fastest: bool = False
) -> float:
    """Median (or, `fastest`, the shortest) wall time of `fn` in ms, after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1000 * (min(times) if fastest else sorted(times)[len(times) // 2])


def step_costs(
    model,
    context: list[int],
    drafter_for: Callable[[TreeBuffers], Drafter] | None = None,
    sizes: tuple[int, ...] = SIZES,
    repeats: int = 5,
    on_size: Callable[[int], None] = lambda n: None,
) -> list[StepCost]:
    """The cost of one step after `context`, for each tree size. `drafter_for(tree)` builds the
    drafter whose proposal is timed (None: the tree's tokens are given, drafting costs 0)."""
    device = model.device
    sync = synchronizer(device)
    settings = DecodeSettings()
    cache = kv.new_cache(model)
    with torch.inference_mode():
        fwd = prefill(model, cache, torch.tensor(context, device=device))
    past = kv.length(cache)
    hidden, root = fwd.hidden[-1], torch.tensor(context[-1], device=device)
    out = []
    for n in sizes:
        on_size(n)
        tree = shaped_tree(n).to(device)
        drafter = drafter_for(tree) if drafter_for and n > 1 else None
        tokens = torch.tensor((context * (n // len(context) + 1))[:n], device=device)  # real tokens
        draft = Draft(tokens, tree) if n > 1 else NoDrafter(device).propose(hidden, root)
        parts = _parts(model, cache, past, draft, settings, repeats, sync)

        def whole(draft=draft, drafter=drafter) -> None:
            with torch.inference_mode():
                d = drafter.propose(hidden, root, context) if drafter else draft
                if d.tree.size != draft.tree.size:  # a drafter may graft more nodes: keep the size
                    d = draft
                commit(cache, past, accept(verify(model, cache, d), d, settings, None))
                kv.truncate(cache, past)

        draft_ms = time_ms(lambda d=drafter: d.propose(hidden, root, context), repeats, sync) if drafter else 0.0
        out.append(StepCost(n, time_ms(whole, repeats, sync), draft_ms, **parts))
    return out


def _parts(model, cache, past: int, draft: Draft, settings: DecodeSettings, repeats: int, sync) -> dict[str, float]:
    """Each part of verify → accept → commit timed alone (the cache is cut back after each)."""
    tree = draft.tree
    with torch.inference_mode():
        mask = tree_mask(model, draft, past)
        hidden = decoder_layers(model, cache, draft, mask, past)[0]
        kv.truncate(cache, past)
        fwd = Forward(project(model, hidden), hidden)
        result = accept(fwd, draft, settings, None)

        def layers() -> None:
            decoder_layers(model, cache, draft, mask, past)
            kv.truncate(cache, past)

        def commit_only() -> None:
            decoder_layers(model, cache, draft, mask, past)
            commit(cache, past, result)
            kv.truncate(cache, past)

        timed = {
            "mask_ms": time_ms(lambda: tree_mask(model, draft, past), repeats, sync) if tree.size > 1 else 0.0,
            "layers_ms": time_ms(layers, repeats, sync),
            "lm_head_ms": time_ms(lambda: project(model, hidden), repeats, sync),
            "accept_ms": time_ms(lambda: accept(fwd, draft, settings, None), repeats, sync),
        }
        timed["commit_ms"] = max(time_ms(commit_only, repeats, sync) - timed["layers_ms"], 0.0)
    return timed


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
