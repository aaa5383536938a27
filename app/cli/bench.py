"""`medusa-chat bench`: decoding modes compared on a prompt file, interleaved per prompt."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from importlib import resources
from pathlib import Path

from app.cli.options import check_seeds, decoding_options, read_labelled, setup, writable
from core.errors import UserError

HELP = "compare decoding modes on a prompt file (the table on stdout)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompts", help='JSONL file, one {"prompt": ...} per line (with --context: default the shipped chat prompts)'
    )
    p.add_argument(
        "--context",
        metavar="N,N,…",
        help="prompt lengths in tokens, such as 100,1000,4000: every prompt runs at each length (after earlier text "
        "that fills it up), and a table gives each mode's time to first token, prompt tokens read a second and "
        "decode tokens a second by length",
    )
    p.add_argument(
        "--modes",
        help="comma-separated: medusa, lookup, retrieval, hybrid (tree decoding with that drafter), baseline (our "
        "plain loop), hf, hf-bf16, hf-pld (stock transformers generate on an unmodified copy of the model: fp32, bf16, "
        "and prompt lookup), llamacpp (llama.cpp on the same GGUF, if installed); "
        "default: drafter,baseline,hf,hf-bf16 (CPUs with native bf16 and GPUs),hf-pld",
    )
    p.add_argument("--system", help="system prompt for every prompt")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the results here")
    decoding_options(p)
    p.set_defaults(max_new_tokens=128)


def run(args: argparse.Namespace) -> int:
    from app.bench import (
        TREE_MODES,
        acceptance_lines,
        agreement,
        by_category,
        category_table,
        context_table,
        is_fixed,
        precision_label,
        run_bench,
        summarize,
        table,
    )
    from core.decode import precision

    # 1) what runs: the modes, the prompts (checked before anything loads)
    modes = _modes(args)
    lengths = _lengths(args.context)
    if not args.prompts and not lengths:
        raise UserError("bench needs a prompt file: pass --prompts FILE (or --context N,… for the shipped prompts).")
    labelled = read_labelled(args.prompts or str(resources.files("assets") / "bench" / "chat.jsonl"))
    if args.json_out:  # refused now, not after the whole bench has run
        writable(Path(args.json_out).expanduser(), "--json")
    prompts, categories = [p for p, _ in labelled], [c for _, c in labelled]
    check_seeds(args.seed, len(prompts), "prompts")  # prompt i is seeded with --seed + i
    kinds = tuple(m for m in modes if m in TREE_MODES)
    fixed = tuple(m for m in modes if is_fixed(m))
    # 2) the model, its drafters and the other engines
    settings, backbone, drafters, preset, costs = setup(args, kinds if kinds or fixed else None, fixed)
    if costs is not None:  # measured before anything else runs, so nothing distorts it
        costs.measure()
    if "default" in modes:  # the model's own drafter
        modes = (next(iter(drafters)), *modes[1:])
    modes, peers, stock = _peers(modes, backbone, max(lengths, default=0) + settings.max_new_tokens)
    encoded = [backbone.encode_chat(p, args.system) for p in prompts]
    print(
        f"bench: {len(prompts)} prompts × {', '.join(modes)} on {args.model} "
        f"({precision_label(backbone.model)}, {backbone.backend.describe()} forward)",
        file=sys.stderr,
    )

    def bench(prompt_ids: list[list[int]]) -> list:
        return run_bench(
            prompt_ids, modes, backbone.backend, settings, drafters, backbone.eos_ids, args.seed, _log_run, peers, stock
        )

    # 3) every prompt in every mode, interleaved per prompt
    rows = []
    if lengths:  # every prompt at every length, numbered on from one length to the next
        runs, rows = _by_context(backbone, prompts, lengths, args.system, settings, bench)
    else:
        runs = bench(encoded)
    replies = len(prompts) * (len(lengths) or 1)  # per mode
    # 4) the tables, and the --json report
    summary = summarize(runs)
    per_category = by_category(runs, categories) if not lengths else {}  # by length instead
    print(table(summary, replies))
    if depths := acceptance_lines(summary):
        print(depths)
    exactness = precision.exactness(backbone.backend, settings)
    print(f"{agreement(summary, replies, precision_label(backbone.model))} ({exactness})", file=sys.stderr)
    if per_category:
        print()
        print(category_table(per_category, modes[0]))
    if rows:
        print()
        print(context_table(rows))
    if args.json_out:
        report = _report(
            args, backbone, settings, preset, len(prompts), modes, summary, per_category, runs, rows, exactness
        )
        _save(json.dumps(report, indent=2) + "\n", Path(args.json_out).expanduser())
    return 0


def _log_run(run) -> None:
    """One line on stderr per finished run."""
    print(
        f"  prompt {run.prompt + 1:>3} {run.mode:<9} {run.tokens:>4} tokens {run.steps:>4} steps {run.seconds:6.2f} s",
        file=sys.stderr,
    )


def _modes(args: argparse.Namespace) -> tuple[str, ...]:
    """--modes (checked), or by default the drafter (the model's own: "default"), our plain loop,
    stock transformers (also in bf16 where that is its fastest dtype) and its prompt lookup."""
    import torch

    from app.bench import check_modes
    from core.decode.tree import AUTO, load_preset
    from core.measure.kernels import native_bf16

    if args.modes:
        return check_modes(args.modes.split(","))
    default = args.drafter or (load_preset(args.tree).drafter if args.tree != AUTO else None)
    bf16 = ("hf-bf16",) if native_bf16() or torch.cuda.is_available() else ()  # stock's fastest dtype too
    return (default or "default", "baseline", "hf", *bf16, "hf-pld")


def _peers(modes: tuple[str, ...], backbone, context: int) -> tuple[tuple[str, ...], dict, dict]:
    """(modes, llama.cpp peers, stock copies): the other engines loaded for prompts and replies up to
    `context` tokens, and the modes left (without llama.cpp if missing, nor stock copies skipped)."""
    from app.bench import STOCK_DTYPES
    from models.stock import stock_peers

    peers = {}
    if "llamacpp" in modes:
        peers["llamacpp"] = _llamacpp(backbone, context)
        modes = tuple(m for m in modes if m != "llamacpp" or peers["llamacpp"])
    # one copy per dtype; on a GPU in the backbone's own 4-bit setting, or skipped where memory is short
    stock, skipped = stock_peers(backbone, {m: STOCK_DTYPES[m] for m in modes if m in STOCK_DTYPES})
    for sentence in skipped:
        print(sentence, file=sys.stderr)
    return tuple(m for m in modes if m not in STOCK_DTYPES or m in stock), peers, stock


def _report(
    args: argparse.Namespace,
    backbone,
    settings,
    preset,
    prompts: int,
    modes: tuple[str, ...],
    summary: dict,
    per_category: dict,
    runs: list,
    rows: list,
    exactness: str,
) -> dict:
    """The --json report: the model and how it ran, the settings, the summary and every run."""
    from app.bench import TREE_MODES, is_fixed, precision_label, speedups
    from core.decode.tree import AUTO

    return {
        "model": args.model,
        "dtype": str(backbone.model.dtype).removeprefix("torch."),
        "forward": backbone.backend.describe(),
        "precision": precision_label(backbone.model),
        "exactness": exactness,
        "agreement": {m: s.exact for m, s in summary.items() if s.exact is not None},
        "tree": args.tree if args.tree == AUTO else preset.name,
        "lookup": {"branches": preset.lookup_branches, "length": preset.lookup_length},
        "settings": asdict(settings),
        "prompts": prompts,
        "summary": {m: asdict(s) for m, s in summary.items()},
        "speedup": speedups(summary, modes[0]),
        "speedups": {m: speedups(summary, m) for m in modes if m in TREE_MODES or is_fixed(m)},
        "categories": {c: {m: asdict(s) for m, s in per.items()} for c, per in per_category.items()},
        "runs": [asdict(r) for r in runs],
        "contexts": [asdict(r) for r in rows],
    }


def _save(text: str, out: Path) -> None:
    """Write the report to `out`; if that fails after all (the disk filled up, the folder went
    away), to a file of its own in the temporary folder, so a long bench's results are not lost."""
    try:
        out.write_text(text, encoding="utf-8")
        return
    except OSError as e:
        reason = e.strerror or str(e)
    try:
        with tempfile.NamedTemporaryFile("w", prefix="medusa-bench-", suffix=".json", delete=False) as kept:
            kept.write(text)
    except OSError:
        sys.stderr.write(text)
        raise UserError(f"Cannot write {out} ({reason}); the results are printed above instead.") from None
    raise UserError(f"Cannot write {out} ({reason}); the results are in {kept.name} instead.")


def _lengths(spec: str | None) -> list[int]:
    """--context N,N,…: the prompt lengths asked for ([] without the option)."""
    if spec is None:
        return []
    try:
        lengths = [int(n) for n in spec.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise UserError(f"--context takes prompt lengths in tokens such as 100,1000,4000, not '{spec}'.")
    return lengths


def _by_context(backbone, prompts: list[str], lengths: list[int], system: str | None, settings, bench):
    """The runs of `bench` over `prompts` lengthened to each of `lengths` tokens (prompt i at the
    k-th length numbered k·len(prompts) + i), and the rows of `app.bench.by_context`."""
    from dataclasses import replace

    from app.bench import by_context
    from core.decode.generate import context_length

    room = context_length(backbone.model) - settings.max_new_tokens
    if max(lengths) > room:
        raise UserError(
            f"--context {max(lengths)} leaves no room for {settings.max_new_tokens} new tokens in the model's "
            f"{room + settings.max_new_tokens}; ask for at most {room}."
        )
    notes = _notes(backbone)
    by_length = {}
    for k, n in enumerate(lengths):
        runs = bench([_lengthened(backbone, p, n, system, notes) for p in prompts])
        by_length[n] = [replace(r, prompt=k * len(prompts) + r.prompt) for r in runs]
    return [r for runs in by_length.values() for r in runs], by_context(by_length)


def _notes(backbone) -> list[int]:
    """Varied text to lengthen prompts with: the shipped seed prompts, one a line, as token ids."""
    seed = Path(str(resources.files("assets") / "prompts" / "seed.jsonl"))
    text = "\n".join(p for p, _ in read_labelled(str(seed)))
    return backbone.tokenizer.encode(text, add_special_tokens=False)


def _lengthened(backbone, prompt: str, length: int, system: str | None, notes: list[int]) -> list[int]:
    """`prompt` as a chat prompt of about `length` tokens: the notes that fill it up, then the prompt."""
    room = length - len(backbone.encode_chat(prompt, system)) - 2  # and two for the blank line
    if room <= 0:
        return backbone.encode_chat(prompt, system)
    filler = backbone.tokenizer.decode(notes[:room])
    return backbone.encode_chat(f"{filler}\n\n{prompt}", system)


def _llamacpp(backbone, context: int = 0):
    """llama.cpp on the GGUF file the model was read from (the embedded model's, a `.gguf` given by
    path, a catalog CPU entry's), on as many threads as torch uses, for prompts and replies up to
    `context` tokens (0: its default); None if missing."""
    import torch

    from models import llamacpp

    if backbone.gguf is None:
        raise UserError(
            "The llamacpp mode runs the model's own GGUF file, and this model was not read from one; "
            "give --model a .gguf file, the embedded model or a catalog CPU entry."
        )
    if context:
        return llamacpp.load(backbone.gguf, torch.get_num_threads(), max(context, 4096))
    return llamacpp.load(backbone.gguf, torch.get_num_threads())
