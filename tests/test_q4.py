"""core.backends.q4: the 4-bit kernel computes what its torch reference computes, in both variants, gives
each row the same result at any row count, and its cached library is rebuilt when it is damaged
or stale, or left for torch's kernel (with the reason) where it cannot be built."""

import os
import subprocess
import sys

import pytest
import torch

from core.backends import abi, q4, q4build, quantize, stepops
from core.backends import lean as fast
from tests.helpers import kernel_variants as variants
from tests.helpers import library_or_skip as loaded


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A process that has not loaded the library yet, with an empty user cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(q4, "_state", {})
    return tmp_path


def packed(weight, bias=None, variant=None):
    lib = loaded()
    layer = q4.Packed(lib, weight, bias)
    if variant:
        layer.variant = q4.ISAS[variant]
    return layer


@pytest.mark.parametrize("variant", ["avx512-vnni", "avx2"])
@pytest.mark.parametrize(("out", "inp", "rows"), [(32, 64, 3), (48, 96, 1), (960, 576, 70), (16, 32, 9)])
def test_kernel_matches_its_reference(variant, out, inp, rows):
    """Odd tile counts, a single tile, one row and more rows than one pass takes."""
    if variant not in variants():
        pytest.skip(f"this CPU does not run the {variant} variant")
    gen = torch.Generator().manual_seed(out + rows)
    weight = torch.randn(out, inp, generator=gen) * 0.05
    bias = torch.randn(out, generator=gen)
    x = torch.randn(rows, inp, generator=gen).to(torch.bfloat16)
    x[0, :5] *= 30  # an outlier sets its group's scale
    got = packed(weight, bias, variant)(x).float()
    want = quantize.reference(x, weight, bias)
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("variant", ["avx512-vnni", "avx2"])
def test_every_row_rounds_alike_at_any_row_count(variant):
    if variant not in variants():
        pytest.skip(f"this CPU does not run the {variant} variant")
    gen = torch.Generator().manual_seed(3)
    layer = packed(torch.randn(96, 128, generator=gen) * 0.05, None, variant)
    x = torch.randn(20, 128, generator=gen).to(torch.bfloat16)
    whole = layer(x)
    for start, stop in ((0, 1), (3, 4), (0, 5), (7, 20)):
        assert torch.equal(layer(x[start:stop]), whole[start:stop])


def test_strided_rows_and_other_dtypes_go_through_packed_linear():
    """PackedLinear feeds the kernel contiguous bf16 rows and gives back the input's dtype; a shape
    the kernel does not take (outputs not a multiple of 16) runs as a plain matmul."""
    loaded()
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 64, generator=gen) * 0.05
    layer = fast.PackedLinear(weight.to(torch.bfloat16), None, "q4")
    x = torch.randn(4, 128, generator=gen).to(torch.bfloat16)[:, ::2]  # rows with a stride
    assert torch.equal(layer(x), layer(x.contiguous()))
    assert layer(x.float()).dtype == torch.float32
    assert fast.PackedLinear(torch.randn(40, 64).to(torch.bfloat16), None, "q4").kernel == "dense"


def _only_artifact(folder):
    (path,) = (folder / "medusa-chat" / "kernels").glob("q4gemm-*.so")
    return path


def _launch(cache) -> subprocess.CompletedProcess:
    """A later launch: a new process loads the kernel from the user cache `cache`."""
    code = (
        "import sys; from core.backends import q4, q4build; lib = q4.library(); "
        "sys.exit(lib is None or lib.q4_version() != q4build.VERSION)"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_damaged_cached_library_is_deleted_and_rebuilt(fresh):
    loaded()
    path = _only_artifact(fresh)
    truncated = path.read_bytes()[:4000]
    path.unlink()  # a new file: this process keeps the old one mapped
    path.write_bytes(truncated)
    later = _launch(fresh)
    assert later.returncode == 0 and "was unusable" in later.stderr
    assert later.stderr.count("\n") == 1  # one sentence
    assert _only_artifact(fresh).stat().st_size > 4000
    again = _launch(fresh)
    assert again.returncode == 0 and again.stderr == ""  # a good one loads quietly


def test_stale_cached_library_is_rebuilt(fresh):
    """A library of another version of the kernel under the same name (a stale build)."""
    loaded()
    path = _only_artifact(fresh)
    source = fresh / "old.c"
    source.write_text("int q4_version(void) { return 0; }\n")
    subprocess.run([q4build.compiler(), "-shared", "-fPIC", str(source), "-o", str(fresh / "old.so")], check=True)
    (fresh / "old.so").replace(path)
    stamp = path.with_suffix(".sha256")
    stamp.write_text(f"0 {q4build.digest(path)}")  # intact, as it was built: found stale before loading
    later = _launch(fresh)
    assert later.returncode == 0 and "version 0" in later.stderr
    stamp.write_text(f"{q4build.VERSION} {q4build.digest(path)}")  # a stale library that claims the version
    (fresh / "old.so").unlink(missing_ok=True)
    subprocess.run([q4build.compiler(), "-shared", "-fPIC", str(source), "-o", str(fresh / "old.so")], check=True)
    (fresh / "old.so").replace(path)
    stamp.write_text(f"{q4build.VERSION} {q4build.digest(path)}")
    later = _launch(fresh)
    assert later.returncode == 0 and "version 0" in later.stderr  # caught once loaded, and replaced


def test_without_a_compiler_the_reason_is_given_and_torch_int4_stays(fresh, monkeypatch, capsys):
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    assert q4.library() is None
    assert "no-such-compiler was not found" in q4.unavailable()
    assert capsys.readouterr().err.count("\n") == 1  # one sentence
    assert not fast.kernel_works("q4", torch.bfloat16)
    assert fast.PackedLinear(torch.randn(32, 64).to(torch.bfloat16), None, "int4").kernel == "int4"


def ops_or_skip(variant: str) -> stepops.Ops:
    """The step ops of a variant, or of an attention kernel beyond vectors ("amx": AVX-512 with
    attention on AMX, its scores and values; "dot": the same in AVX-512's bf16 and VNNI products;
    "dot-scores": its scores so, the values in vectors)."""
    tiles = variant in stepops.NAMES
    if tiles and not (loaded() and stepops.can_attend_with(variant)):
        pytest.skip(f"this CPU (or its Linux) does not run the {variant} attention kernel")
    if not tiles and variant not in variants():
        pytest.skip(f"this CPU does not run the {variant} variant")
    loaded()
    ops = stepops.ops(torch.bfloat16)
    ops.variant = q4.ISAS["avx512-vnni"] | stepops.KERNELS[variant] if tiles else q4.ISAS[variant]
    return ops


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("variant", ["avx512-vnni", "avx2", *stepops.NAMES])
@pytest.mark.parametrize(
    "heads, kv, d, past", [(6, 2, 32, 37), (9, 3, 64, 1001), (4, 1, 48, 150), (8, 2, 128, 300), (9, 3, 64, 1535)]
)
def test_attention_matches_torch_and_a_tree_node_equals_a_one_token_step(variant, heads, kv, d, past, bits):
    """GQA with a tree mask against torch's sdpa (head sizes whose vectors split unevenly, query
    counts a kv head that are not multiples of the kernel's groups, prefixes of odd lengths); then
    node 3 of the tree, whose ancestors sit at scattered slots, against a one-token step over the
    same keys laid out as an accepted path (prefix, then its ancestors in order): the same bits.
    With 8-bit keys and values (an 8-bit StaticKV's rows) torch reads their values dequantized."""
    ops = ops_or_skip(variant)
    gen = torch.Generator().manual_seed(5)
    parents = [-1, 0, 0, 1, 1, 2]  # a tree of 6 nodes after the prefix
    t, length = len(parents), past + len(parents)
    seen = torch.zeros(t, length, dtype=torch.bool)
    seen[:, :past] = True
    for node, parent in enumerate(parents):
        seen[node, past + node] = True
        while parent >= 0:
            seen[node, past + parent], parent = True, parents[parent]
    mask = torch.zeros(t, length).masked_fill(~seen, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
    keys = torch.randn(kv, length + 20, d, generator=gen).to(torch.bfloat16)
    values = torch.randn(kv, length + 20, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(t, heads, d, generator=gen).to(torch.bfloat16)
    exact = keys.float(), values.float()
    if bits == 8:
        keys, values = fast.kv.to_kv8(keys), fast.kv.to_kv8(values)
        exact = fast.kv.from_kv8(keys), fast.kv.from_kv8(values)
    got = ops.attention(q, keys, values, length, mask).view(t, heads, d)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], exact[0][:, :length][None], exact[1][:, :length][None],
        attn_mask=mask.float()[None, None], enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    assert (got.float() - want).abs().max() < 2e-2
    node, path = 3, [past + 0, past + 1, past + 3]  # node 3's ancestors 0 and 1, then itself
    order = list(range(past)) + path
    plain_keys, plain_values = keys[:, order].contiguous(), values[:, order].contiguous()
    one = ops.attention(q[node : node + 1], plain_keys, plain_values, len(order), None)
    assert torch.equal(one.view(heads, d), got[node])


def test_8_bit_cache_rows_are_written_in_c_as_in_torch():
    """The decoder's cache writes (q4_kv8_store) give `to_kv8`'s rows byte for byte: a row of
    zeros, an even ramp, and random rows; each value within half a step of its row's scale."""
    lib = loaded()
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(6, 64, generator=gen) * 3).to(torch.bfloat16)
    x[0] = 0
    x[1] = torch.arange(64) - 31.5  # an even ramp, top 31.5
    want = fast.kv.to_kv8(x)
    got = torch.zeros_like(want)
    for r in range(x.shape[0]):
        lib.q4_kv8_store(x[r].data_ptr(), 64, got[r].data_ptr())
    assert torch.equal(got, want)
    assert torch.equal(fast.kv.from_kv8(want)[0], torch.zeros(64))
    assert (fast.kv.from_kv8(want) - x.float()).abs().max() <= x.float().abs().max() / 254 * 1.001


@pytest.mark.parametrize("variant", ["avx512-vnni", "avx2"])
def test_argmax_gives_torchs_indices(variant, monkeypatch):
    """stepops.argmax (greedy acceptance's, for bf16 logits on the CPU) gives torch's argmax in each
    variant: the first of equal values, a NaN as the largest, a row of -inf's first index, one row
    or many (at the vocabularies' sizes and a few values), and declines strided rows and other dtypes."""
    loaded()
    if variant not in variants():
        pytest.skip(f"this CPU does not run the {variant} kernels")
    monkeypatch.setattr(stepops, "isa", lambda: variant)
    gen = torch.Generator().manual_seed(3)
    for rows, vocab in ((1, 49152), (16, 262144), (5, 7)):
        x = torch.randn(rows, vocab, generator=gen).to(torch.bfloat16)
        x[0, vocab // 2] = x[0, vocab // 3] = x[0].max() + 1  # a tie: the first wins
        if rows > 2:
            x[1, 3], x[1, 5] = float("nan"), float("nan")
            x[2] = float("-inf")
        assert torch.equal(stepops.argmax(x), x.float().argmax(-1))
        assert torch.equal(stepops.argmax(x[0]), x[0].float().argmax(-1))
    assert stepops.argmax(torch.randn(3, 10).to(torch.bfloat16)[:, ::2]) is None
    assert stepops.argmax(torch.randn(3, 10)) is None


@pytest.mark.parametrize("variant", ["avx512-vnni", "avx2"])
def test_top_gives_torchs_top_k_and_log_sum_exp(variant, monkeypatch):
    """stepops.top (the heads' candidates) gives torch's topk values, indices that hold them (of
    equal values the lower index first), and logsumexp to float rounding, in each variant, over
    rows of the vocabularies' sizes, a short row, a row with -inf's, strided rows; and declines a
    NaN, +inf, strided columns, other dtypes and k out of range."""
    loaded()
    if variant not in variants():
        pytest.skip(f"this CPU does not run the {variant} kernels")
    monkeypatch.setattr(stepops, "isa", lambda: variant)
    gen = torch.Generator().manual_seed(4)
    for rows, vocab, k in ((4, 49152, 10), (3, 262144, 10), (2, 7, 7), (5, 37, 1)):
        x = (torch.randn(rows, vocab + 3, generator=gen) * 4).to(torch.bfloat16)[:, :vocab]  # rows ld apart
        x[0, vocab // 2] = x[0, vocab // 3] = x[0, vocab // 4] = x[0].max() + 1  # a three-way tie at the top
        x[-1, : vocab // 2] = float("-inf")
        values, indices, norms = stepops.top(x, k)
        assert torch.equal(values, x.topk(k).values.float())
        assert torch.equal(x.gather(1, indices).float(), values)
        assert all(len(set(row)) == k for row in indices.tolist())
        if k >= 3 and vocab > 7:
            assert indices[0, :3].tolist() == [vocab // 4, vocab // 3, vocab // 2]
        assert torch.allclose(norms, x.float().logsumexp(-1), rtol=1e-5, atol=1e-5)
    x = torch.randn(3, 100, generator=gen).to(torch.bfloat16)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 50] = bad
        assert stepops.top(y, 5) is None
    assert stepops.top(x[:, ::2], 5) is None and stepops.top(x.float(), 5) is None
    assert stepops.top(x, 0) is None and stepops.top(x, 101) is None and stepops.top(x[0], 5) is None


@pytest.mark.parametrize("variant", ["avx512-vnni", "avx2"])
def test_rms_norm_matches_llama(variant):
    ops = ops_or_skip(variant)
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(5, 96, generator=gen) * 3).to(torch.bfloat16)
    weight = torch.rand(96, generator=gen).to(torch.bfloat16)
    got = ops.rms_norm(x, weight, 1e-5)
    hidden = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    want = weight * hidden.to(torch.bfloat16)
    assert (got.float() - want.float()).abs().max() <= 2 * 2**-8 * want.float().abs().max()
    assert torch.equal(ops.rms_norm(x[2:3], weight, 1e-5), got[2:3])


def amx_loaded():
    loaded()
    if not q4.amx():
        pytest.skip("no AMX here (or Linux does not grant this process the tile state)")


@pytest.mark.parametrize("bits", [4, 8])
def test_amx_passes_give_the_vnni_passes_bits(bits):
    """Every row count, past a tile of rows and with a partial one (zeros pad it), with a bias:
    AMX's rows equal VNNI's and a one-row product's bit for bit (the integer sums are exact and
    the float epilogue is the same), so which path a row count takes changes no output."""
    amx_loaded()
    gen = torch.Generator().manual_seed(bits)
    layer = q4.Packed(q4.library(), torch.randn(80, 320, generator=gen) * 0.05, torch.randn(80, generator=gen), bits)
    x = torch.randn(40, 320, generator=gen).to(torch.bfloat16)
    x[3, :7] *= 40  # an outlier sets its group's scale
    layer.amx = 0
    vnni = {rows: layer(x[:rows]) for rows in (1, 2, 5, 8, 9, 16, 17, 33, 40)}
    ones = torch.cat([layer(x[r : r + 1]) for r in range(40)])
    layer.amx = 1
    assert layer.amx == 1
    for rows, want in vnni.items():
        got = layer(x[:rows])
        assert torch.equal(got, want), rows
        assert torch.equal(got, ones[:rows]), rows


def test_each_weight_keeps_the_amx_row_count_it_was_packed_with():
    """A model's weights take AMX from its own measured count: a draft model packed next, with
    another count, leaves them theirs."""
    amx_loaded()
    gen = torch.Generator().manual_seed(7)
    try:
        q4.use_amx(8)
        first = q4.Packed(q4.library(), torch.randn(32, 64, generator=gen), None)
        q4.use_amx(16)
        second = q4.Packed(q4.library(), torch.randn(32, 64, generator=gen), None)
        assert (first.amx, second.amx, q4.amx_from()) == (8, 16, 16)
    finally:
        q4.use_amx(0)
    assert q4.Packed(q4.library(), torch.randn(32, 64, generator=gen), None).amx == 0


def test_8bit_vnni_passes_give_the_avx2_passes_bits():
    """8-bit weights: VNNI (weights shifted by 128 in registers, the rows' 128·Σp taken back out)
    and AVX2 (the sign trick) make the same exact integer sums, so the same bits, at every row
    count and with an outlier, an extreme weight and an all-zero group."""
    if set(variants()) != {"avx512-vnni", "avx2"}:
        pytest.skip("this CPU does not run both variants")
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(80, 320, generator=gen) * 0.05
    weight[3, :32], weight[5, 40] = 0, 4.0
    bias = torch.randn(80, generator=gen)
    x = torch.randn(70, 320, generator=gen).to(torch.bfloat16)
    x[2, :7] *= 40
    x[4, 64:96] = 0
    layers = {v: q4.Packed(loaded(), weight, bias, 8, v) for v in ("avx512-vnni", "avx2")}
    for rows in (1, 3, 4, 5, 17, 70):
        assert torch.equal(layers["avx512-vnni"](x[:rows]), layers["avx2"](x[:rows])), rows


@pytest.mark.parametrize("bits", [4, 8])
def test_avx_vnni_passes_give_the_avx2_passes_bits(bits):
    """The AVX2 variant on AVX-VNNI (256-bit `vpdpbusd`, int32 sums) and on AVX2 alone (int16
    sums, then int32): the same exact integer sums, so the same bits at every row count."""
    lib = loaded()
    if "avx2" not in variants() or lib.q4_avx_vnni(0) != 0:
        pytest.skip("this CPU has no AVX-VNNI")
    gen = torch.Generator().manual_seed(10 + bits)
    layer = q4.Packed(lib, torch.randn(80, 320, generator=gen) * 0.05, torch.randn(80, generator=gen), bits, "avx2")
    x = torch.randn(11, 320, generator=gen).to(torch.bfloat16)
    x[2, :7] *= 40
    try:
        plain = {rows: layer(x[:rows]) for rows in (1, 3, 4, 5, 11)}
        assert lib.q4_avx_vnni(1) == 0
        for rows, want in plain.items():
            assert torch.equal(layer(x[:rows]), want), rows
    finally:
        lib.q4_avx_vnni(0)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_weights_prefetched_to_l2_give_the_same_bits(bits):
    """The few-row and 8-bit passes' prefetches to L2 (`q4_prefetch_l2`) or L1 move no bit: every
    variant here, every row count, 4-, 5- (fifth bits from a file's blocks) and 8-bit weights, over
    tiles whose prefetches run past their ends."""
    lib = loaded()
    gen = torch.Generator().manual_seed(20 + bits)
    weight, bias = torch.randn(80, 512, generator=gen) * 0.05, torch.randn(80, generator=gen)
    x = torch.randn(9, 512, generator=gen).to(torch.bfloat16)
    for variant in variants():
        layer = q4.Packed(lib, weight, bias, bits, variant)
        if bits == 5:  # fifth bits set at random: a 5-bit weight as a file's blocks give it
            layer.high.copy_(torch.randint(0, 256, layer.high.shape, generator=gen, dtype=torch.uint8))
        try:
            near = {rows: layer(x[:rows]) for rows in (1, 2, 3, 4, 5, 9)}
            assert lib.q4_prefetch_l2(3) == 0  # both kinds of pass
            for rows, want in near.items():
                assert torch.equal(layer(x[:rows]), want), (variant, rows)
        finally:
            lib.q4_prefetch_l2(0)


def test_a_compiler_without_amx_and_avx_vnni_builds_the_library_without_them(tmp_path):
    """GCC before 11 and clang before 12 know neither AMX nor AVX-VNNI: built as they would build
    it (`Q4_NEW_ISAS=0`), the library says no to both and computes the same bits."""
    lib = loaded()
    target = tmp_path / "old.so"
    flags = [*q4build.FLAGS, "-DQ4_NEW_ISAS=0", *map(str, q4build.SOURCES), "-o", str(target)]
    subprocess.run([q4build.compiler(), *flags], check=True, capture_output=True, timeout=300)
    old = abi.load(target, q4build.VERSION)
    assert old.q4_amx() == -1 and old.q4_avx_vnni(1) == -1
    gen = torch.Generator().manual_seed(12)
    weight, x = torch.randn(48, 96, generator=gen) * 0.05, torch.randn(5, 96, generator=gen).to(torch.bfloat16)
    assert torch.equal(q4.Packed(old, weight, None)(x), q4.Packed(lib, weight, None)(x))
