"""Benchmark: the same prompts through several decoding modes on one loaded model.

Modes run interleaved prompt by prompt, so slow drift of the machine (heat, other load) hits
them alike. `medusa`, `lookup` and `hybrid` are our tree loop with that drafter, `baseline`
our plain loop; `hf` and `hf-bf16` are stock transformers
`generate` (an unmodified copy of the model, fp32 and bf16) with the same sampling settings and
`hf-pld` its prompt-lookup decoding; `llamacpp`
is llama.cpp on the same GGUF file (through a function the caller passes in). A "step"
is one forward of the backbone (counted with a hook for the transformers modes), the prefill
included, so tokens per step is the paper's acceleration rate and plain decoding gives 1.0.

By context length (`by_context`): the same prompts lengthened to N tokens, each mode's time to
first token (the prompt's reading), prompt tokens read a second, and decode tokens a second after
the first token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel

from core.backends.base import Backend
from core.decode import precision
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.drafters.base import Drafter
from core.drafters.registry import DRAFTERS
from core.errors import UserError
from core.measure.clock import now

TREE_MODES = DRAFTERS  # our tree loop, named by its drafter
PEERS = ("llamacpp",)  # other engines, run through a function the caller supplies
STOCK_DTYPES = {"hf": torch.float32, "hf-bf16": torch.bfloat16, "hf-pld": torch.float32}  # stock transformers modes
MODES = (*TREE_MODES, "baseline", *STOCK_DTYPES, *PEERS)
# → (reply, seconds) or (reply, seconds, seconds to the first token)
Peer = Callable[
    [list[int], DecodeSettings, tuple[int, ...]], tuple[tuple[int, ...], float] | tuple[tuple[int, ...], float, float]
]
PLD_TOKENS = 10  # prompt-lookup draft length, the value transformers documents


@dataclass(frozen=True)
class Run:
    mode: str
    prompt: int  # index in the prompt file
    tokens: int
    steps: int
    seconds: float
    draft_seconds: float = 0.0  # time spent building trees (tree modes)
    token_ids: tuple[int, ...] = ()  # the reply, to compare with the plain loop's
    nodes: int = 0  # verify-forward tokens over the decode steps (tree modes and baseline)
    plain_steps: int = 0  # decode steps whose tree was the root alone
    first_token_seconds: float = 0.0  # the prefill: the prompt read, the first token chosen (0: not measured)
    prompt_tokens: int = 0
    depths: tuple[
        tuple[int, int], ...
    ] = ()  # per draft depth: (steps that offered a node there, steps that accepted one)


@dataclass(frozen=True)
class Summary:
    tokens: int
    steps: int
    seconds: float
    tokens_per_second: float
    tokens_per_step: float
    step_ms: float  # mean wall time of one step
    draft_share: float = 0.0  # share of the time spent building trees (tree modes)
    exact: int | None = None  # prompts whose reply equals the plain loop's token for token (None: no baseline run)
    first_difference: float | None = None  # mean position of the first differing token, over the prompts that differ
    mean_nodes: float = 0.0  # tree modes: mean verify-forward size of a decode step (1 = plain)
    plain_share: float = 0.0  # tree modes: share of decode steps the policy (or tree) ran plain
    acceptance: tuple[float, ...] = ()  # tree modes: per depth, accepted ÷ offered where the path reached it


def check_modes(modes: Iterable[str]) -> tuple[str, ...]:
    """The modes asked for: MODES, or DRAFTER@PRESET (that drafter on a fixed tree preset)."""
    modes = tuple(m.strip() for m in modes if m.strip())
    unknown = [m for m in modes if m not in MODES and not is_fixed(m)]
    if unknown or not modes:
        raise UserError(
            f"Unknown bench mode {', '.join(unknown) or '(none)'}; choose from {', '.join(MODES)} "
            "or DRAFTER@PRESET such as hybrid@cpu-8."
        )
    return modes


def is_fixed(mode: str) -> bool:
    """A DRAFTER@PRESET mode: tree decoding on a fixed preset, to compare with the policy's choice."""
    kind, at, preset = mode.partition("@")
    return bool(at) and kind in TREE_MODES and bool(preset)


def run_once(
    mode: str,
    backend: Backend,
    prompt_ids: list[int],
    settings: DecodeSettings,
    drafters: dict[str, Drafter],
    eos_ids: tuple[int, ...],
    seed: int,
    peers: dict[str, Peer] | None = None,
    stock: dict[str, PreTrainedModel] | None = None,
) -> tuple[int, int, float, float, tuple[int, ...], int, int, float, int, tuple[tuple[int, int], ...]]:
    """(tokens, steps, seconds, seconds spent drafting, the reply, verify nodes, plain steps, seconds
    to the first token, prompt tokens, per-depth acceptance counts) of one reply in one mode (verify
    nodes, plain steps and depths empty outside our loop). `stock`: the unmodified model for each
    transformers mode (default: `backend`'s)."""
    n = len(prompt_ids)
    if mode in PEERS:  # one token per forward
        reply, seconds, *first = (peers or {})[mode](prompt_ids, settings, eos_ids)
        return len(reply), len(reply), seconds, 0.0, reply, 0, 0, first[0] if first else 0.0, n, ()
    if mode == "baseline" or mode in drafters:
        generator = torch.Generator(backend.device).manual_seed(seed)
        events, done = collect(
            stream(
                backend,
                prompt_ids,
                settings,
                drafters.get(mode),
                None,
                eos_ids,
                generator,
            )
        )
        drafting = sum(e.draft_seconds for e in events)
        nodes = sum(max(e.tree_size, 1) for e in events[1:])
        plain = sum(e.tree_size <= 1 for e in events[1:])
        first = done.first_token_seconds
        depths = depth_counts(events[1:])
        return len(done.token_ids), done.steps, done.seconds, drafting, done.token_ids, nodes, plain, first, n, depths
    reply, steps, seconds, first = _run_hf(
        mode, (stock or {}).get(mode, backend.model), prompt_ids, settings, eos_ids, seed
    )
    return len(reply), steps, seconds, 0.0, reply, 0, 0, first, n, ()


def depth_counts(events) -> tuple[tuple[int, int], ...]:
    """Per draft depth d (1, 2, …): how many steps offered a node at depth d under the accepted
    path's node at depth d − 1, and how many of those accepted one (the acceptance rate by depth)."""
    offered: list[int] = []
    accepted: list[int] = []
    for e in events:
        parents, path = e.parents, e.path
        if len(parents) <= 1:
            continue
        for d in range(1, len(path) + 1):
            if not any(parents[c] == path[d - 1] for c in range(1, len(parents))):
                break  # nothing drafted under the deepest accepted node
            while len(offered) < d:
                offered.append(0)
                accepted.append(0)
            offered[d - 1] += 1
            accepted[d - 1] += d < len(path)
    return tuple(zip(offered, accepted, strict=True))


def acceptance(runs: list[Run]) -> tuple[float, ...]:
    """Accepted ÷ offered per depth over `runs`."""
    depth = max((len(r.depths) for r in runs), default=0)
    totals = [[0, 0] for _ in range(depth)]
    for r in runs:
        for d, (o, a) in enumerate(r.depths):
            totals[d][0] += o
            totals[d][1] += a
    return tuple(a / o if o else 0.0 for o, a in totals)


def acceptance_lines(summary: dict[str, Summary]) -> str:
    """One line per tree mode: its acceptance rate at each draft depth."""
    lines = [
        f"acceptance by depth, {mode}: " + " ".join(f"{a:.2f}" for a in s.acceptance)
        for mode, s in summary.items()
        if s.acceptance
    ]
    return "\n".join(lines)


def _run_hf(
    mode: str,
    model: PreTrainedModel,
    prompt_ids: list[int],
    settings: DecodeSettings,
    eos_ids: tuple[int, ...],
    seed: int,
) -> tuple[tuple[int, ...], int, float, float]:
    """(reply, forwards, seconds, seconds to the end of the first forward: the prefill)."""
    sampling = settings.temperature > 0
    options = {
        "max_new_tokens": settings.max_new_tokens,
        "do_sample": sampling,
        "temperature": settings.temperature if sampling else None,
        "top_p": settings.top_p if sampling else None,
        "top_k": settings.top_k if sampling else None,
        "eos_token_id": list(eos_ids) or None,
        "pad_token_id": eos_ids[0] if eos_ids else None,
    }
    if mode == "hf-pld":
        options["prompt_lookup_num_tokens"] = PLD_TOKENS
    calls, ends = [0], []
    hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    first = model.register_forward_hook(lambda *_: None if ends else ends.append(now(model.device)))
    try:
        ids = torch.tensor([prompt_ids], device=model.device)
        # generate() samples from torch's own generator: seed it inside a fork that restores it
        with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
            torch.manual_seed(seed)
            start = now(model.device)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
            seconds = now(model.device) - start
    finally:
        hook.remove()
        first.remove()
    return tuple(out[0, len(prompt_ids) :].tolist()), calls[0], seconds, ends[0] - start if ends else 0.0


def run_bench(
    prompts: list[list[int]],
    modes: tuple[str, ...],
    backend: Backend,
    settings: DecodeSettings,
    drafters: dict[str, Drafter],
    eos_ids: tuple[int, ...],
    seed: int = 0,
    progress: Callable[[Run], None] = lambda run: None,
    peers: dict[str, Peer] | None = None,
    stock: dict[str, PreTrainedModel] | None = None,
) -> list[Run]:
    """Warm every mode up, then run each prompt through every mode in turn."""
    warm = DecodeSettings(**{**asdict(settings), "max_new_tokens": 8})
    for mode in modes:
        run_once(mode, backend, prompts[0], warm, drafters, eos_ids, seed, peers, stock)
    runs = []
    for i, ids in enumerate(prompts):
        for mode in modes:
            run = Run(mode, i, *run_once(mode, backend, ids, settings, drafters, eos_ids, seed + i, peers, stock))
            progress(run)
            runs.append(run)
    return runs


def summarize(runs: list[Run]) -> dict[str, Summary]:
    plain = {r.prompt: r.token_ids for r in runs if r.mode == "baseline"}
    out = {}
    for mode in dict.fromkeys(r.mode for r in runs):
        mine = [r for r in runs if r.mode == mode]
        tokens, steps = sum(r.tokens for r in mine), sum(r.steps for r in mine)
        seconds = sum(r.seconds for r in mine)
        drafting = sum(r.draft_seconds for r in mine)
        exact, first = fidelity([(r.token_ids, plain[r.prompt]) for r in mine if r.prompt in plain])
        decode_steps = max(steps - len(mine), 1)  # the prefills are not decode steps
        out[mode] = Summary(
            tokens, steps, seconds, tokens / seconds, tokens / steps, 1000 * seconds / steps, drafting / seconds,
            exact if plain else None, first, sum(r.nodes for r in mine) / decode_steps,
            sum(r.plain_steps for r in mine) / decode_steps, acceptance(mine),
        )  # fmt: skip
    return out


def by_category(runs: list[Run], categories: list[str]) -> dict[str, dict[str, Summary]]:
    """`summarize` over each category's prompts (`categories[i]` labels prompt i)."""
    return {c: summarize([r for r in runs if categories[r.prompt] == c]) for c in dict.fromkeys(categories) if c}


def category_table(per: dict[str, dict[str, Summary]], of: str, ref: str = "baseline") -> str:
    """Tokens/s of every mode per category, and `of` relative to `ref` in each."""
    if not per:
        return ""
    modes = list(next(iter(per.values())))
    lines = [f"{'category':<12}" + "".join(f"{m[:14]:>15}" for m in modes) + f"{of[:10] + ' × ' + ref[:8]:>22}"]
    for cat, summary in per.items():
        ratio = (
            summary[of].tokens_per_second / summary[ref].tokens_per_second if of in summary and ref in summary else 0
        )
        cells = "".join(f"{summary[m].tokens_per_second:>15.1f}" for m in modes)
        lines.append(f"{cat[:12]:<12}{cells}{ratio:>21.2f}×")
    return "\n".join(lines)


def fidelity(pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[int, float | None]:
    """How many replies equal their reference, and the mean index of the first differing token
    over those that do not (a reply that stops early differs where it stops)."""
    firsts = [first_difference(a, b) for a, b in pairs]
    differ = [f for f in firsts if f is not None]
    return len(firsts) - len(differ), (sum(differ) / len(differ) if differ else None)


def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def precision_label(model: PreTrainedModel) -> str:
    """The precision our loop ran in: "bfloat16", or "nf4 weights, bfloat16 compute"."""
    compute = str(precision.compute_dtype(model)).removeprefix("torch.")
    quant = precision.quantization(model)
    return f"{quant} weights, {compute} compute" if quant else compute


def agreement(summary: dict[str, Summary], prompts: int, label: str) -> str:
    """One line: for every mode, how many of the `prompts` replies equal the plain loop's token
    for token, in the precision `label` (the "= plain" column of `table`)."""
    counts = [
        f"{mode} {s.exact}/{prompts}" for mode, s in summary.items() if s.exact is not None and mode != "baseline"
    ]
    if not counts:
        return f"agreement with the plain loop in {label}: no plain loop ran"
    return f"agreement with the plain loop in {label}: {', '.join(counts)}"


def speedups(summary: dict[str, Summary], of: str = "medusa") -> dict[str, float]:
    """Tokens/s of `of` divided by each other mode's."""
    if of not in summary:
        return {}
    mine = summary[of].tokens_per_second
    return {m: mine / s.tokens_per_second for m, s in summary.items() if m != of}


def table(summary: dict[str, Summary], prompts: int) -> str:
    """One row per mode; then its speed relative to `hf` and `baseline`, how many of the
    `prompts` replies equal the plain loop's token for token, and where the others first differ."""
    refs = [m for m in ("hf", "hf-bf16", "baseline") if m in summary]
    header = ["mode", "tokens", "steps", "tok/step", "nodes", "step ms", "draft %", "seconds", "tok/s"]
    header += [f"× {m}" for m in refs] + ["= plain", "1st diff"]
    widths = [22, 8, 8, 10, 7, 9, 9, 9, 8] + [11] * len(refs) + [9, 9]
    cells = zip(header, widths, strict=True)
    lines = ["".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(cells))]
    for mode, s in summary.items():
        ratios = "".join(f"{s.tokens_per_second / summary[m].tokens_per_second:>10.2f}×" for m in refs)
        exact = "—" if s.exact is None else f"{s.exact}/{prompts}"
        first = "—" if s.first_difference is None else f"{s.first_difference:.1f}"
        lines.append(
            f"{mode:<22}{s.tokens:>8}{s.steps:>8}{s.tokens_per_step:>10.2f}{s.mean_nodes or 0:>7.1f}{s.step_ms:>9.1f}"
            f"{100 * s.draft_share:>9.1f}{s.seconds:>9.1f}{s.tokens_per_second:>8.1f}{ratios}{exact:>9}{first:>9}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class ContextRow:
    mode: str
    context: int  # the prompts' mean length in tokens
    first_token_ms: float  # mean time to the first token (0: not measured)
    read_per_second: float  # prompt tokens read a second in that time
    decode_per_second: float  # tokens a second after the first


def by_context(runs: dict[int, list[Run]]) -> list[ContextRow]:
    """Each mode's row at each context length (`runs` by the length asked for)."""
    return [
        _context_row(mode, [r for r in rs if r.mode == mode])
        for rs in runs.values()
        for mode in dict.fromkeys(r.mode for r in rs)
    ]


def _context_row(mode: str, runs: list[Run]) -> ContextRow:
    """Decode speed counts the tokens after the first and the time after it (where the first token
    was not timed, every token over the whole time)."""
    first = sum(r.first_token_seconds for r in runs)
    prompt = sum(r.prompt_tokens for r in runs)
    after = sum(r.seconds for r in runs) - first
    decoded = sum(r.tokens - (1 if first else 0) for r in runs)
    return ContextRow(
        mode, round(prompt / len(runs)), 1000 * first / len(runs), prompt / first if first else 0.0,
        decoded / after if after > 0 else 0.0,
    )  # fmt: skip


def context_table(rows: list[ContextRow]) -> str:
    """One line per mode and context length; decode speed also relative to the mode's shortest context."""
    shortest = {}
    for r in sorted(rows, key=lambda r: r.context):
        shortest.setdefault(r.mode, r.decode_per_second)
    lines = [f"{'mode':<22}{'context':>9}{'1st token ms':>14}{'read tok/s':>12}{'decode tok/s':>14}{'× shortest':>12}"]
    for r in rows:
        first = f"{r.first_token_ms:.0f}" if r.first_token_ms else "—"
        read = f"{r.read_per_second:.0f}" if r.read_per_second else "—"
        ratio = r.decode_per_second / shortest[r.mode] if shortest[r.mode] else 0.0
        lines.append(f"{r.mode:<22}{r.context:>9}{first:>14}{read:>12}{r.decode_per_second:>14.1f}{ratio:>11.2f}×")
    return "\n".join(lines)
