"""`medusa-chat bench`: decoding modes compared on a prompt file, interleaved per prompt."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from app.cli.options import decoding_options, read_labelled, setup
from core.errors import UserError

HELP = "compare decoding modes on a prompt file (the table on stdout)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help='JSONL file, one {"prompt": ...} per line')
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
    import torch

    from core import fast
    from core.bench import (
        STOCK_DTYPES,
        TREE_MODES,
        by_category,
        category_table,
        check_modes,
        is_fixed,
        run_bench,
        speedups,
        summarize,
        table,
    )
    from core.tree import AUTO, load_preset
    from core.tune.kernels import native_bf16
    from models.loader import load_stock

    if args.modes:
        modes = check_modes(args.modes.split(","))
    else:
        default = args.drafter or (load_preset(args.tree).drafter if args.tree != AUTO else None)
        bf16 = ("hf-bf16",) if native_bf16() or torch.cuda.is_available() else ()  # stock's fastest dtype too
        modes = (default or "default", "baseline", "hf", *bf16, "hf-pld")
    labelled = read_labelled(args.prompts)
    prompts, categories = [p for p, _ in labelled], [c for _, c in labelled]
    kinds = tuple(m for m in modes if m in TREE_MODES)
    fixed = tuple(m for m in modes if is_fixed(m))
    settings, backbone, drafters, preset, costs = setup(args, kinds if kinds or fixed else None, fixed)
    if costs is not None:  # measured before anything else runs, so nothing distorts it
        costs.measure()
    if "default" in modes:  # the model's own drafter
        modes = (next(iter(drafters)), *modes[1:])
    peers = {}
    if "llamacpp" in modes:
        peers["llamacpp"] = _llamacpp(args.model)
        modes = tuple(m for m in modes if m != "llamacpp" or peers["llamacpp"])
    stock_modes = [m for m in modes if m in STOCK_DTYPES]
    by_dtype = {d: load_stock(backbone, d) for d in {STOCK_DTYPES[m] for m in stock_modes}}  # one copy per dtype
    stock = {m: by_dtype[STOCK_DTYPES[m]] for m in stock_modes}
    encoded = [backbone.encode_chat(p, args.system) for p in prompts]
    print(
        f"bench: {len(prompts)} prompts × {', '.join(modes)} on {args.model} "
        f"({str(backbone.model.dtype).removeprefix('torch.')}, {fast.describe(backbone.model)} forward)",
        file=sys.stderr,
    )

    def progress(run) -> None:
        print(
            f"  prompt {run.prompt + 1:>3} {run.mode:<9} {run.tokens:>4} tokens "
            f"{run.steps:>4} steps {run.seconds:6.2f} s",
            file=sys.stderr,
        )

    runs = run_bench(
        encoded, modes, backbone.model, settings, drafters, backbone.eos_ids, args.seed, progress, peers, stock
    )
    summary = summarize(runs)
    per_category = by_category(runs, categories)
    print(table(summary, len(prompts)))
    if per_category:
        print()
        print(category_table(per_category, modes[0]))
    if args.json_out:
        report = {
            "model": args.model,
            "dtype": str(backbone.model.dtype).removeprefix("torch."),
            "forward": fast.describe(backbone.model),
            "tree": args.tree if args.tree == AUTO else preset.name,
            "lookup": {"branches": preset.lookup_branches, "length": preset.lookup_length},
            "settings": asdict(settings),
            "prompts": len(prompts),
            "summary": {m: asdict(s) for m, s in summary.items()},
            "speedup": speedups(summary, modes[0]),
            "speedups": {m: speedups(summary, m) for m in modes if m in TREE_MODES or is_fixed(m)},
            "categories": {c: {m: asdict(s) for m, s in per.items()} for c, per in per_category.items()},
            "runs": [asdict(r) for r in runs],
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def _llamacpp(model: str):
    """llama.cpp on the embedded model's GGUF, on as many threads as torch uses; None if missing."""
    import torch

    from models import llamacpp
    from models.embedded import EMBEDDED_ID, embedded_gguf

    if model != EMBEDDED_ID:
        raise UserError(f"The llamacpp mode runs the embedded model's GGUF file; use --model {EMBEDDED_ID}.")
    return llamacpp.load(embedded_gguf(), torch.get_num_threads())
