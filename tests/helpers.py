"""Tiny models built from configs and test drafters: no downloads, no weights on disk."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from core.backends import lean as fast
from core.backends import q4, q4build
from core.backends.base import Backend
from core.backends.torch import TorchBackend
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import TreeBuffers
from core.drafters.base import Draft, Drafter

BASE_ARCHS = ("llama", "qwen2")


def library_builds() -> bool:
    """Whether this machine can build core.backends.q4's library (a C compiler, AVX2). Where it can, a
    kernel of the library that does not work fails tests instead of skipping them."""
    try:
        q4build.compiler()
    except OSError:
        return False
    return q4.isa() is not None


def library_or_skip():
    """The kernel library: skip where this machine cannot build it; fail where it should work."""
    lib = q4.library()
    if lib is None:
        if library_builds():
            pytest.fail(f"the kernel library should work here: {q4.unavailable()}")
        pytest.skip(f"no kernel library here: {q4.unavailable()}")
    return lib


def require_kernel(kernel: str, dtype: torch.dtype) -> None:
    """Skip where `kernel` cannot run in `dtype` on this machine; fail where it should run."""
    if fast.kernel_works(kernel, dtype):
        return
    if kernel in ("q4", "q8") and library_builds():
        pytest.fail(f"the {kernel} kernel should run here: {q4.unavailable()}")
    pytest.skip(f"{kernel} does not run in {dtype} on this CPU")


FAST_KERNELS = tuple(k for k in ("dense", "onednn") if fast.kernel_works(k, torch.float32))
# "arch+kernel": the model served by core.backends.lean's lean forward with that kernel (fp32)
ARCHS = (*BASE_ARCHS, *(f"{a}+{k}" for a in BASE_ARCHS for k in FAST_KERNELS))


def kernel_variants() -> list[str]:
    """The kernel variants this CPU can run (AVX-512 VNNI runs only where the CPU has it)."""
    best = q4.isa()
    return [] if best is None else [v for v in q4.ISAS if q4.ISAS[v] <= q4.ISAS[best]]


def unpacked(packed: q4.Packed) -> Tensor:
    """A 4- or 5-bit `q4.Packed` weight's values (N, K) as the kernel multiplies them: step·q + minimum."""
    n, k = packed.n, packed.k
    groups = k // 32
    nibbles = packed.w.view(-1, groups, 4, q4.TILE, 4)  # (tile, group, h, j, i)
    q = torch.stack([nibbles & 15, nibbles >> 4], dim=-1)  # (tile, group, h, j, i, half)
    q = q.permute(0, 3, 1, 2, 5, 4).reshape(n, groups, 32).float()  # (tile, j, group, h, half, i)
    if packed.bits == 5:  # mask 2h + half's bit 4j + i: the fifth bit of value 8h + 4·half + i of output j
        bits = (packed.high.view(-1, groups, 64, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
        bits = bits.view(-1, groups, 4, 2, q4.TILE, 4)  # (tile, group, h, half, j, i)
        q = q + 16 * bits.permute(0, 4, 1, 2, 3, 5).reshape(n, groups, 32).float()
    step, low = (x.transpose(1, 2).reshape(n, groups, 1) for x in packed.groups())
    return (q * step + low).view(n, k)


def tiny_backend(arch: str = "llama", vocab: int = 96, seed: int = 0) -> Backend:
    """A random model of `arch` behind its backend: transformers' (`TorchBackend`); "llama+onednn"
    and the like: the lean backend `core.backends.lean.accelerate` returns for that kernel ("+int4"
    and "+q4" run in bf16)."""
    arch, _, kernel = arch.partition("+")
    model = _tiny(arch, vocab, seed)
    if not kernel:
        return TorchBackend(model)
    four_bit = kernel in ("int4", "q4")
    if four_bit:
        model = model.to(torch.bfloat16)
    return fast.accelerate(model, kernel, "dense" if four_bit else kernel)


def tiny_model(arch: str = "llama", vocab: int = 96, seed: int = 0):
    """The model of `tiny_backend(arch, vocab, seed)` (packed in place for "arch+kernel")."""
    return tiny_backend(arch, vocab, seed).model


def _tiny(arch: str, vocab: int, seed: int):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,  # peakier logits than the default 0.02: fewer near-ties
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False)).eval()
    raise ValueError(arch)


def plain_tokens(
    backend: Backend, prompt: list[int], n: int, settings: DecodeSettings | None = None, generator=None
) -> list[int]:
    settings = settings or DecodeSettings(max_new_tokens=n)
    _, done = collect(stream(backend, prompt, settings, None, generator=generator))
    return list(done.token_ids)


class OracleDrafter(Drafter):
    """Knows the true continuation and places it along the path to a random node of the tree.

    Greedy decoding must then accept exactly that path: every length, through any branch, so
    the commit has to move non-adjacent cache entries.
    """

    def __init__(self, reference: list[int], tree: TreeBuffers, vocab: int, seed: int = 0) -> None:
        self.reference, self.tree, self.vocab = reference, tree, vocab
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int]) -> Draft:
        pos = len(history)  # index in `reference` of the token after the root
        target = int(torch.randint(0, self.tree.size, (), generator=self.rng))
        on_track = self.tree.visible[target]  # (T,) the target and its ancestors
        tokens = [int(root)]
        for node, path in enumerate(self.tree.paths, start=1):
            d = len(path)
            truth = self.reference[pos + d - 1] if pos + d - 1 < len(self.reference) else 0
            # siblings stay distinct: only one of them can be on track, the rest are offset by rank
            tokens.append(truth if on_track[node] else (truth + 1 + path[-1]) % self.vocab)
        return Draft(torch.tensor(tokens), self.tree)


def brute_force_continuations(ids: Sequence[int], max_ngram: int, max_count: int, length: int) -> list[list[int]]:
    """The same answer as `NgramIndex.continuations`, by scanning the whole history (the reference for tests)."""
    found: list[list[int]] = []
    last = len(ids) - 1
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        suffix = list(ids[last - n + 1 :])
        for end in range(last - 1, n - 2, -1):
            if list(ids[end - n + 1 : end + 1]) == suffix:
                cont = list(ids[end + 1 : end + 1 + length])
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) == max_count:
                        return found
    return found


def exact_three_tokens(model, prompt: list[int], vocab: int) -> dict[tuple[int, int, int], float]:
    """The model's exact probability of every three-token continuation of `prompt` (sampling at
    temperature 1), from one batched forward over every two-token prefix."""
    with torch.inference_mode():
        seqs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        logp = model(seqs).logits.log_softmax(-1)  # (vocab², len(prompt) + 2, V)
    n0 = len(prompt) - 1
    return {
        (a, b, c): float((logp[i, n0, a] + logp[i, n0 + 1, b] + logp[i, n0 + 2, c]).exp())
        for i, (a, b) in enumerate(itertools.product(range(vocab), repeat=2))
        for c in range(vocab)
    }


def three_token_p_value(
    backend: Backend, prompt: list[int], vocab: int, drafter, seed: int = 11, n: int = 3000,
    on_events: Callable[[list], None] = lambda events: None,
) -> float:  # fmt: skip
    """Chi-square p-value of `n` three-token replies sampled at temperature 1 with `drafter`
    against the model's exact distribution; `on_events` sees each reply's step events."""
    from tests.stats import chi_square_p_value

    settings, gen, counts = (
        DecodeSettings(temperature=1.0, max_new_tokens=3),
        torch.Generator().manual_seed(seed),
        Counter(),
    )
    for _ in range(n):
        events, done = collect(stream(backend, prompt, settings, drafter, generator=gen))
        counts[done.token_ids] += 1
        on_events(events)
    return chi_square_p_value(counts, exact_three_tokens(backend.model, prompt, vocab), n)


def tiny_eagle_draft(model, seed: int = 3, vocab=None):
    """A random EAGLE draft layer for `model` (its vocabulary, or `vocab`'s ids), peaky enough
    that its guesses differ from noise."""
    from core.drafters.eagle import EagleDraft

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        size = model.get_output_embeddings().weight.shape[0]
        draft = EagleDraft(model, torch.arange(size) if vocab is None else vocab)
        for p in draft.parameters():  # peaky enough that the draft's guesses differ from noise
            torch.nn.init.normal_(p, std=0.3)
    return draft.eval()
