"""`medusa-chat calibrate`: measure the heads and this machine; write the fastest tree preset."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.cli.options import model_options, read_prompts, writable
from core.errors import UserError

HELP = "measure the heads and this machine; write the tree preset that decodes fastest"


def add_arguments(p: argparse.ArgumentParser) -> None:
    model_options(p)
    p.add_argument("--prompts", help="JSONL calibration prompts (default: the shipped calibration set)")
    p.add_argument("--max-prompts", type=int, default=60, help="use at most this many prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="0,1,2,3,4,6,8,10,12,16,20,24,32,48,64", help="tree sizes to try")
    p.add_argument("--out", help="preset file to write (default: ./MODEL-calibrated.json)")


def run(args: argparse.Namespace) -> int:
    from importlib import resources

    from tqdm.auto import tqdm

    from core.train import calibrate as cal
    from models.loader import heads_for, load_backbone, resolve, resolve_heads

    try:
        budgets = sorted({int(b) for b in args.budgets.split(",")})
    except ValueError:
        raise UserError(
            f"--budgets must be comma-separated node counts such as 0,4,8,16, not {args.budgets!r}."
        ) from None
    if budgets[0] < 0 or budgets[-1] > 128 or args.max_prompts < 1:
        raise UserError("--budgets must lie in 0…128 and --max-prompts be at least 1.")
    default_prompts = Path(str(resources.files("assets") / "prompts" / "calibration.jsonl"))
    prompts = read_prompts(args.prompts or str(default_prompts))[: args.max_prompts]
    spec = resolve(args.model)
    heads_dir = resolve_heads(args.heads) if args.heads else spec.heads_folder
    if not heads_dir:
        raise UserError(f"{args.model} has no Medusa heads to calibrate; pass --heads FOLDER or train some first.")
    out = Path(args.out).expanduser() if args.out else Path(f"{spec.name.replace('/', '--')}-calibrated.json")
    writable(out, "--out")  # before the measuring starts
    backbone = load_backbone(args.model, args.dtype, args.device, args.quantization, spec=spec)
    model = backbone.model
    heads, _ = heads_for(backbone, heads_dir)

    with tqdm(total=len(prompts), desc="greedy replies", unit="prompt") as bar:
        encoded = [backbone.encode_chat(p) for p in prompts]
        result = cal.calibrate(
            backbone.backend, heads, encoded, backbone.eos_ids, backbone.pad_id, args.max_new_tokens, budgets,
            cal.LOOKUP_SETTINGS, lambda n: bar.update(n), lambda text: print(text, file=sys.stderr),
        )  # fmt: skip
    ranked, accuracy, verify_ms = result.ranked, result.accuracy, result.verify_ms
    heads_ms, lookup_ms, plain_ms, replies = result.heads_ms, result.lookup_ms, result.plain_ms, result.replies
    best = ranked[0]
    if best.drafter == "plain":  # a preset is a tree: write the fastest one, and say plain wins
        best = next(c for c in ranked if c.drafter != "plain")
        print("plain decoding is the fastest on this machine; use --mode baseline for it.", file=sys.stderr)
    print(f"\n{'drafter':<8}{'nodes':>6}{'lookup':>8}{'tok/step':>10}{'avg T':>7}{'step ms':>9}{'tok/s':>8}")
    shown = ranked[:8] + [c for c in ranked if c.drafter == "plain"]
    for c in shown:
        look = f"{c.branches}×{c.length}" if c.branches else "—"
        print(
            f"{c.drafter:<8}{len(c.paths):>6}{look:>8}{c.tokens_per_step:>10.2f}{c.mean_nodes:>7.1f}"
            f"{c.step_ms:>9.1f}{c.tokens_per_second:>8.1f}"
        )
    preset = {
        "paths": best.paths,
        "drafter": best.drafter,
        "lookup": {"branches": best.branches or 2, "length": best.length or 4},
        "calibration": {
            "model": args.model, "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type,
            "replies": len(replies), "positions": sum(r.match.shape[0] for r in replies),
            "top1": [round(a, 4) for a in accuracy[:, 0].tolist()],
            "top10": [round(a, 4) for a in accuracy.sum(dim=1).tolist()],
            "reliability": [[round(a, 4) for a in head] for head in result.reliability.tolist()],
            "verify_ms": {n: round(v, 2) for n, v in verify_ms.items()},
            "heads_ms": round(heads_ms, 2), "lookup_ms": round(lookup_ms, 2), "plain_step_ms": round(plain_ms, 2),
            "expected_tokens_per_step": round(best.tokens_per_step, 3), "expected_nodes": round(best.mean_nodes, 2),
            "expected_speedup_over_plain": round(best.tokens_per_second / (1000 / plain_ms), 3),
            "best_per_drafter": {
                kind: {
                    "paths": c.paths, "lookup": {"branches": c.branches, "length": c.length},
                    "tokens_per_step": round(c.tokens_per_step, 3), "nodes": round(c.mean_nodes, 2),
                    "step_ms": round(c.step_ms, 2), "tokens_per_second": round(c.tokens_per_second, 2),
                }
                for kind in ("plain", "medusa", "lookup", "hybrid")
                if (c := next((c for c in ranked if c.drafter == kind), None))
            },
        },
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(preset, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}: {best.drafter}, {len(best.paths)} head nodes; use it with --tree {out}", file=sys.stderr)
    return 0
