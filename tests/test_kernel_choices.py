"""Kernel choices that hold from launch to launch, the many-row 4-bit kernel's exactness at wider
layers, and the profile's floor for one more tree row."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from core.backends import lean as fast
from core.backends import q4, stepops
from core.drafters.policy import CostCurve
from core.measure import clock, cpu_attention, kernels, profile
from tests.helpers import library_or_skip as _library
from tests.helpers import tiny_backend
from tests.tiny_folder import save_tiny_model


class NoisyClock:
    """Injected timings: a row count's true cost (8 rows at twice one row: on the edge of the
    lm_head's by-node rule) times ±25 % noise, calls taken as one row and eight rows by turns."""

    def __init__(self, seed: int) -> None:
        self.rng, self.calls = random.Random(seed), 0

    def __call__(self, fn, repeats=5, sync=None, fastest=False) -> float:
        self.calls += 1
        return (1.0 if self.calls % 2 else 2.0) * self.rng.uniform(0.75, 1.25)


def test_five_launches_make_the_same_choices_and_measure_the_curve_once(tmp_path, monkeypatch):
    _library()
    from models import loader

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = save_tiny_model(tmp_path / "model")
    noisy, rng = NoisyClock(0), random.Random(1)
    monkeypatch.setattr(clock, "time_ms", noisy)  # whatever times the lm_head reads noise
    monkeypatch.setattr(kernels, "time_ms", noisy)

    def seconds(choice, hidden, inner, repeats=3):  # as `kernels._seconds`: None where a kernel does not run here
        works = all(fast.kernel_works(k, kernels.DTYPES[choice.dtype]) for k in (choice.kernel, choice.head_kernel))
        return rng.uniform(1.0, 1.3) if works else None

    monkeypatch.setattr(kernels, "_seconds", seconds)
    seen = []
    for launch in range(5):
        backbone = loader.load_backbone(str(spec.folder), quantization="int4", spec=spec)
        backend = backbone.backend
        seen.append((backend.layer_kernel, backend.model.get_output_embeddings().kernel, backend.row_head))
        costs = loader.step_costs(backbone, None)
        assert costs.needed == (launch == 0), f"launch {launch + 1} measures the step-cost curve again"
        if launch == 0:  # as the first launch's measurement would
            costs.store.save(costs.key, CostCurve({1: 1.0, 2: 1.2, 4: 1.5}, 0.0))
    assert len(set(seen)) == 1, seen


def _record(tmp_path, entries: dict) -> tuple:
    path = tmp_path / "cpu-kernels.json"
    path.write_text(json.dumps(entries))
    return path


def test_a_remeasured_choice_replaces_the_earlier_one_only_when_it_wins_clearly(tmp_path, monkeypatch):
    _library()
    earlier = kernels.Choice("bfloat16", "q4", "q8")
    other = kernels.Choice("bfloat16", "q4", "onednn")
    key = kernels.record_key("64x128", "auto", "int4")
    old_key = kernels._LIBRARY_ID.sub("|kernels 000000000000", key)
    assert old_key != key
    for new_time, kept in ((0.95, True), (0.8, False)):  # the other candidate 5 % faster, then 20 %
        record = _record(tmp_path, {old_key: {"dtype": "bfloat16", "kernel": "q4", "head_kernel": "q8"}})
        times = {earlier: 1.0, other: new_time}
        monkeypatch.setattr(kernels, "_seconds", lambda c, h, i, repeats=3, times=times: times.get(c, 5.0))
        choice = kernels.choose(64, 128, None, True, record)
        assert choice == (earlier if kept else other)
        assert kernels.Choice(**json.loads(record.read_text())[key]) == choice


def test_a_remeasured_drafting_kernel_replaces_the_earlier_one_only_when_it_wins_clearly(tmp_path, monkeypatch):
    _library()
    key = kernels.record_key(f"draft 4x64x{fast.padded_rows(96)}")
    old_key = kernels._LIBRARY_ID.sub("|kernels 000000000000", key)
    # float32 oneDNN: a candidate every CPU runs (its bf16 form needs AVX-512 or AVX-NE-CONVERT)
    for new_time, want in ((0.95, ("bfloat16", "q4")), (0.8, ("float32", "onednn"))):
        record = _record(tmp_path, {old_key: ["bfloat16", "q4"]})
        times = {("bfloat16", "q4"): 1.0, ("float32", "onednn"): new_time}

        def timed(fn, repeats=5, sync=None, fastest=False, times=times):
            layer, dt = fn.__defaults__  # the candidate the timed call runs
            return times.get((str(dt).removeprefix("torch."), layer.kernel), 5.0)

        monkeypatch.setattr(kernels, "time_ms", timed)
        assert kernels.drafting(96, 64, 4, record) == want
        assert tuple(json.loads(record.read_text())[key]) == want


def test_a_large_readouts_drafting_kernel_is_timed_on_a_bounded_part_of_it(tmp_path, monkeypatch):
    """A 49,152-token readout 2,048 wide is timed on 8,192 of its outputs (64 MB of float32, still
    beyond the cache): timed whole, its copies in every kernel held 2.5 GB at the first launch."""
    _library()
    shapes = []

    def timed(fn, repeats=5, sync=None, fastest=False):
        layer, _ = fn.__defaults__
        shapes.append((layer.out_features, layer.in_features))
        return 1.0

    monkeypatch.setattr(kernels, "time_ms", timed)
    kernels.drafting(49152, 2048, 4, tmp_path / "record.json")
    assert shapes and set(shapes) == {(8192, 2048)}
    assert kernels.timed_outputs(96, 64) == 96  # a small one whole
    shapes.clear()
    kernels.drafting(96, 64, 4, tmp_path / "other.json")
    assert set(shapes) == {(fast.padded_rows(96), 64)}


def test_the_lm_head_by_node_choice_is_remembered_and_turns_only_on_a_clear_ratio(tmp_path, monkeypatch):
    _library()
    head = fast.PackedLinear(torch.randn(96, 64).to(torch.bfloat16), None, "q8")
    key = kernels.record_key("lm_head by row 96x64", "q8")
    old_key = kernels._LIBRARY_ID.sub("|kernels 000000000000", key)
    for ratio, earlier, want in ((2.1, False, False), (1.9, True, True), (2.5, False, True), (1.5, True, False)):
        record = _record(tmp_path, {old_key: earlier})
        monkeypatch.setattr(kernels, "_head_ratio", lambda head, ratio=ratio: ratio)
        assert kernels.head_by_row(head, record) is want
        monkeypatch.setattr(kernels, "_head_ratio", lambda head: pytest.fail("measured again"))
        assert kernels.head_by_row(head, record) is want  # remembered: nothing is timed


@pytest.mark.parametrize("variant", ["avx512-vnni", "avx2"])
def test_a_tree_row_equals_a_one_row_product_at_wide_layers(variant):
    """Many groups a row (the many-row passes prefetch weights ahead): every row count gives
    each row the bits a one-row product gives it."""
    _library()
    best = q4.isa()
    if best is None or q4.ISAS[variant] > q4.ISAS[best]:
        pytest.skip(f"this CPU does not run the {variant} variant")
    gen = torch.Generator().manual_seed(5)
    layer = q4.Packed(q4.library(), torch.randn(96, 1024, generator=gen) * 0.05, torch.randn(96, generator=gen))
    layer.variant = q4.ISAS[variant]
    x = torch.randn(17, 1024, generator=gen).to(torch.bfloat16)
    ones = torch.cat([layer(x[r : r + 1]) for r in range(17)])
    for rows in (2, 3, 4, 5, 8, 16, 17):
        assert torch.equal(layer(x[:rows]), ones[:rows]), rows


def test_the_profile_states_one_more_rows_floor():
    backend = tiny_backend("llama")
    costs = profile.step_costs(backend, list(range(1, 40)), None, sizes=(1, 4, 8), repeats=1)
    floor = profile.row_floor(backend, costs)
    linears = [m for m in backend.model.modules() if isinstance(m, torch.nn.Linear)]
    assert floor.macs == sum(m.in_features * m.out_features for m in linears) > 0
    assert floor.peak_gmacs > 0 and floor.floor_ms == pytest.approx(floor.macs / floor.peak_gmacs / 1e6, rel=0.01)
    assert set(floor.measured_ms) == {4, 8}
    assert floor.measured_ms[8] == pytest.approx((costs[2].total_ms - costs[0].total_ms) / 7)
    line = profile.floor_line(floor)
    assert f"{floor.floor_ms:.2f} ms" in line and "(to 8)" in line


def test_the_amx_row_count_is_remembered_and_moves_only_on_a_clear_ratio(tmp_path, monkeypatch):
    """From which row count AMX runs: the smallest from which it wins at every count timed,
    measured once (five launches, one measurement), kept over a remeasurement (a new kernel
    library) unless the ratio at the remembered count is clearly on one side."""
    _library()
    monkeypatch.setattr(q4, "amx", lambda: True)
    key = kernels.record_key("amx rows 64x128")
    old_key = kernels._LIBRARY_ID.sub("|kernels 000000000000", key)
    base = {2: 0.6, 4: 0.8, 8: 1.05, 12: 1.3, 16: 1.6, 32: 1.9}  # VNNI's time over AMX's
    calls = []

    def ratios(hidden, inner, table):
        calls.append(table)
        return table

    for table, earlier, want in (
        (base, None, 8),
        (base, 4, 8),  # 4 loses clearly (0.8): the new count
        (base, 12, 8),  # 12 wins clearly (1.3): AMX from 8 wins at every larger count, so 8
        ({**base, 8: 0.97, 12: 1.04}, 8, 8),  # at 8 within 10 %: the remembered 8 stays
        ({**base, 8: 0.97, 12: 1.04}, None, 12),
        ({r: 0.9 for r in base}, None, 0),  # AMX never wins
        ({**base, 16: 0.95}, None, 32),  # wins at every count from 32 only
    ):
        record = _record(tmp_path, {} if earlier is None else {old_key: earlier})
        monkeypatch.setattr(kernels, "_amx_ratios", lambda h, i, table=table: ratios(h, i, table))
        calls.clear()
        for _launch in range(5):
            assert kernels.amx_rows(64, 128, record) == want
        assert len(calls) == 1, "measured once"
        assert json.loads(record.read_text())[key] == want
    monkeypatch.setattr(q4, "amx", lambda: False)
    monkeypatch.setattr(kernels, "_amx_ratios", lambda h, i: pytest.fail("measured without AMX"))
    assert kernels.amx_rows(64, 128, tmp_path / "none.json") == 0


def test_the_amx_row_count_is_measured_on_this_machine(tmp_path):
    """Where AMX runs, a real measurement: ratios at every timed count, a count among them (or 0),
    and the library set to it."""
    _library()
    if not q4.amx():
        pytest.skip("no AMX here")
    ratios = kernels._amx_ratios(64, 256)
    assert set(ratios) == set(kernels.AMX_ROWS) and all(r > 0 for r in ratios.values())
    rows = kernels.amx_rows(64, 256, tmp_path / "record.json")
    assert rows in (0, *kernels.AMX_ROWS)
    q4.use_amx(rows)
    try:
        assert q4.amx_from() == rows
        assert q4.Packed(q4.library(), torch.randn(32, 64), None).amx == rows
    finally:
        q4.use_amx(0)


# A flavor choice: (module, its availability check, the record's key, the measurement, the choice)
FLAVORS = {
    "avx-vnni": (q4, "avx_vnni", "avx-vnni 64x128", kernels, "_avx_vnni_ratio", lambda r: kernels.avx_vnni(64, 128, r)),
    "prefetch-l2": (
        q4, "prefetch_l2", "prefetch l2 64x128", kernels, "_prefetch_l2_ratio",
        lambda r: kernels.prefetch_l2(64, 128, r)[0],
    ),
    "prefetch-l2-8-bit": (
        q4, "prefetch_l2", "prefetch l2 8-bit 64x128", kernels, "_prefetch_l2_ratio",
        lambda r: kernels.prefetch_l2(64, 128, r)[1],
    ),
}  # fmt: skip


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_a_flavor_choice_is_remembered_and_turns_only_on_a_clear_ratio(flavor, tmp_path, monkeypatch):
    _library()
    module, available, name, measuring, measure, choose = FLAVORS[flavor]
    monkeypatch.setattr(module, available, lambda: True)
    old_key = kernels._LIBRARY_ID.sub("|kernels 000000000000", kernels.record_key(name))
    for ratio, earlier, want in ((1.05, False, False), (0.95, True, True), (1.4, False, True), (0.8, True, False)):
        record = _record(tmp_path, {old_key: earlier})
        monkeypatch.setattr(measuring, measure, lambda *shape, ratio=ratio: ratio)
        assert choose(record) is want
        monkeypatch.setattr(measuring, measure, lambda *shape: pytest.fail("measured again"))
        for _launch in range(4):
            assert choose(record) is want  # remembered: nothing is timed
    monkeypatch.setattr(module, available, lambda: False)
    assert choose(tmp_path / "none.json") is False


def test_the_prefetches_are_set_as_measured_and_named(tmp_path, monkeypatch):
    """`prefetch_l2` leaves the library set to both kinds' choices (the 8-bit one timed with the
    4-bit one set), and the forward's name says which kinds prefetch to L2."""
    _library()
    seen = []

    def ratio(hidden, inner, bits, few=False):
        seen.append((bits, few))
        return {4: 1.3, 8: 0.8}[bits]

    monkeypatch.setattr(kernels, "_prefetch_l2_ratio", ratio)
    try:
        assert kernels.prefetch_l2(64, 128, tmp_path / "record.json") == (True, False)
        assert seen == [(4, False), (8, True)]
        assert q4.flavors(0) == ", 4-bit weights prefetched to L2"
        q4.use_prefetch_l2(True, True)
        assert q4.flavors(0) == ", weights prefetched to L2"
        q4.use_prefetch_l2(False, True)
        assert q4.flavors(0) == ", 8-bit weights prefetched to L2"
    finally:
        q4.use_prefetch_l2(False, False)
    assert q4.flavors(0) == ""


def test_avx_vnni_is_not_taken_where_plain_avx2_is_emulated(monkeypatch):
    _library()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not q4.avx_vnni()


def test_the_attention_kernel_is_remembered_and_turns_only_on_a_clear_gain(tmp_path, monkeypatch):
    """Of the kernels the CPU runs, the one with the best gain over vectors (none above 1: vectors);
    remembered (nothing timed at later launches); a measurement with another kernel library keeps
    the earlier choice unless another kernel is `CLEAR_WIN` faster than it."""
    _library()
    monkeypatch.setattr(stepops, "can_attend_with", lambda kernel: True)
    old_key = kernels._LIBRARY_ID.sub(
        "|kernels 000000000000", cpu_attention.timed_key("attention kernel 9x3x64", "16-bit KV")
    )
    cases = (
        ((1.4, 1.2, 1.1), None, "amx"), ((0.9, 1.3, 1.0), None, "dot"), ((0.9, 1.1, 1.2), None, "dot-scores"),
        ((0.8, 0.95, 0.9), None, "vectors"),  # measured afresh
        ((1.05, 1.0, 1.0), "vectors", "vectors"), ((1.3, 1.25, 1.0), "dot", "dot"),
        ((1.5, 1.2, 1.0), "dot", "amx"), ((0.7, 0.8, 0.9), "amx", "vectors"),  # an earlier choice
    )  # fmt: skip
    for gains, earlier, want in cases:
        record = _record(tmp_path, {} if earlier is None else {old_key: earlier})
        gains = dict(zip(("amx", "dot", "dot-scores"), gains, strict=True))
        monkeypatch.setattr(cpu_attention, "_gain", lambda kernel, *shape, gains=gains: gains[kernel])
        assert cpu_attention.attention_kernel(9, 3, 64, 30, record) == want, (gains, earlier)
        monkeypatch.setattr(cpu_attention, "_gain", lambda *shape: pytest.fail("measured again"))
        for _launch in range(4):
            assert cpu_attention.attention_kernel(9, 3, 64, 30, record) == want
    monkeypatch.setattr(stepops, "can_attend_with", lambda kernel: kernel == "vectors")
    assert cpu_attention.attention_kernel(9, 3, 64, 30, tmp_path / "none.json") == "vectors"


def test_a_kernels_gain_is_its_average_unless_one_row_loses_too_much(monkeypatch):
    """A kernel's gain over vectors is its average over `ROWS`, or its one-row ratio where a one-token
    step's attention loses more than `ONE_ROW_LOSS` with it (what plain decoding runs)."""
    monkeypatch.setattr(cpu_attention, "_caches", lambda *shape: [])
    monkeypatch.setattr(q4, "library", lambda: None)
    edge = 1 - cpu_attention.ONE_ROW_LOSS
    for ratios, want in (
        ((1.2, 1.5, 1.8), 1.5),
        ((edge + 0.01, 1.7, 2.0), (edge + 3.71) / 3),
        ((edge - 0.01, 2.0, 2.0), edge - 0.01),
    ):
        monkeypatch.setattr(cpu_attention, "_ratios", lambda heads, d, runs, r=ratios: list(r))
        assert cpu_attention._gain("dot", 9, 3, 64, 30, 8) == pytest.approx(want), ratios


def test_the_attention_kernel_is_measured_on_this_machine(tmp_path):
    """Where the CPU runs a kernel beyond vectors, each is timed (gains in a sane range), the choice is
    one of them and remembered; a model loaded after it names it in its forward."""
    _library()
    assert cpu_attention.attention_kernel(8, 2, 48, 30, tmp_path / "odd.json") == "vectors"  # 48: not on tiles
    assert cpu_attention.attention_kernel(1, 1, 1024, 30, tmp_path / "odd.json") == "vectors"  # beyond the kernel
    kernels_here = [kernel for kernel in stepops.NAMES if stepops.can_attend_with(kernel)]
    if not kernels_here:
        pytest.skip("this CPU runs attention in vectors only (no AMX, nor AVX-512's bf16 and VNNI products)")
    gains = {kernel: cpu_attention._gain(kernel, 9, 3, 64, 30) for kernel in kernels_here}
    assert all(0.2 < gain < 5 for gain in gains.values())
    chosen = cpu_attention.attention_kernel(9, 3, 64, 30, tmp_path / "record.json")
    assert chosen in [*kernels_here, "vectors"]  # which one: timed, so left to the gains' own test above
    assert cpu_attention.attention_kernel(9, 3, 64, 30, tmp_path / "record.json") == chosen  # remembered
    for kernel in kernels_here:
        stepops.use_attention(kernel)
        assert stepops.ops(torch.bfloat16).attention_kernel(64) == kernel
        assert stepops.ops(torch.bfloat16).attention_kernel(48) == "vectors"
    stepops.use_attention("vectors")
    assert stepops.ops(torch.bfloat16).attention_kernel(64) == "vectors"


def test_the_kv_bits_are_remembered_and_turn_only_on_a_clear_gain(tmp_path, monkeypatch):
    """8-bit keys and values where a one-token step and the timed rows (`ROWS`) on average lose
    nothing with them and one of the two gains `KV8_GAIN` (timed with the vector kernel unless
    kernels are given); remembered (nothing timed at later launches); a measurement with another
    kernel library keeps the earlier choice near the threshold."""
    _library()
    monkeypatch.setitem(stepops._chosen, "attention", "amx")
    old_key = kernels._LIBRARY_ID.sub("|kernels 000000000000", cpu_attention.timed_key("kv bits 9x3x64", "vectors"))
    cases = (
        ((1.3, 0.9, 0.9), None, 8), ((1.05, 1.8, 1.6), None, 8),  # one gains, or the average
        ((1.05, 1.0, 1.0), None, 16), ((1.15, 0.8, 0.9), None, 16), ((0.97, 1.8, 1.9), None, 16),  # measured afresh
        ((1.12, 1.0, 1.0), 16, 16), ((1.08, 1.0, 1.0), 8, 8), ((1.25, 1.0, 1.0), 16, 8),  # an earlier choice
        ((1.0, 1.0, 1.0), 8, 16), ((1.15, 0.9, 0.9), 8, 16),
    )  # fmt: skip
    for ratios, earlier, want in cases:
        record = _record(tmp_path, {} if earlier is None else {old_key: earlier})
        monkeypatch.setattr(cpu_attention, "_kv8_ratios", lambda *shape, ratios=ratios: ratios)
        assert cpu_attention.kv_bits(9, 3, 64, 30, record) == want, (ratios, earlier)
        monkeypatch.setattr(cpu_attention, "_kv8_ratios", lambda *shape: pytest.fail("measured again"))
        for _launch in range(4):
            assert cpu_attention.kv_bits(9, 3, 64, 30, record) == want
    assert cpu_attention.kv_bits(4, 4, 40, 30, tmp_path / "odd.json") == 16  # heads the attention kernel does not take


def test_the_kv_bits_weigh_each_with_the_kernel_chosen_for_it(tmp_path, monkeypatch):
    """bf16 and 8-bit keys and values each timed with the attention kernel chosen for them (on Zen 4
    the vector kernel for bf16 and the dot-product scores for 8 bits), and the step ops then take the
    bits chosen with that bits' kernel; without 8 bits (not int4, or a model that would change its
    answers) bf16's kernel, nothing else timed. A remembered choice among other kernels is not reused."""
    _library()
    config = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30)
    by_bits = {16: "vectors", 8: "dot-scores"}
    monkeypatch.setattr(cpu_attention, "attention_kernel", lambda heads, kv, dim, layers, record, bits: by_bits[bits])
    monkeypatch.setattr(stepops, "runnable", lambda kernel: kernel)
    for name in ("attention", "kv bits"):
        monkeypatch.setitem(stepops._chosen, name, stepops._chosen[name])
    timed = []
    for ratios, bits in (((1.3, 1.2, 1.0), 8), ((0.97, 1.4, 1.5), 16)):
        monkeypatch.setattr(cpu_attention, "_kv8_ratios", lambda *shape, r=ratios: timed.append(shape[-1]) or r)
        cpu_attention.use_measured(config, int4=True, record=tmp_path / f"{bits}.json")
        assert (stepops.kv_bits(), stepops.attention()) == (bits, by_bits[bits])
    assert timed == [("vectors", "dot-scores")] * 2
    for int4, kv8 in ((False, True), (True, False)):
        monkeypatch.setattr(cpu_attention, "_kv8_ratios", lambda *shape: pytest.fail("8 bits timed"))
        cpu_attention.use_measured(config, int4=int4, record=tmp_path / "16.json", kv8=kv8)
        assert (stepops.kv_bits(), stepops.attention()) == (16, "vectors")
    by_bits[8] = "amx"  # another kernel for 8 bits: measured again, not the record's "dot-scores" one
    monkeypatch.setattr(cpu_attention, "_kv8_ratios", lambda *shape: timed.append(shape[-1]) or (1.0, 1.0))
    cpu_attention.use_measured(config, int4=True, record=tmp_path / "8.json")
    assert timed[-1] == ("vectors", "amx") and stepops.kv_bits() == 16


def test_the_kv_bits_are_measured_on_this_machine(tmp_path, monkeypatch):
    """Both caches timed at the memory's speed with the vector kernel, and the choice the one
    those very timings call for (a second measurement near the threshold may well disagree: the
    test once compared two and failed on a busy machine)."""
    _library()
    seen = []
    measure = cpu_attention._kv8_ratios
    monkeypatch.setattr(cpu_attention, "_kv8_ratios", lambda *shape: seen.append(measure(*shape)) or seen[-1])
    bits = cpu_attention.kv_bits(9, 3, 64, 30, tmp_path / "record.json")
    [ratios] = seen
    assert len(ratios) == len(cpu_attention.ROWS) and all(0.2 < ratio < 5 for ratio in ratios)
    pair = ratios[0], sum(ratios) / len(ratios)
    assert bits == (8 if max(pair) >= cpu_attention.KV8_GAIN and min(pair) >= 1 else 16)
