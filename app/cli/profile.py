"""`medusa-chat profile`: the cost of one decode step by tree size on this machine, in parts."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from app.cli.options import model_options
from core.errors import UserError

HELP = "measure one decode step by tree size on this machine, split into its parts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    model_options(p)
    p.add_argument("--sizes", default="1,2,4,8,16,32,64", help="tree sizes in nodes, the root included (1…64)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure (the median is kept)")
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache before the step")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    from core.drafters.fixed import MedusaDrafter
    from core.measure import profile
    from models.loader import heads_for, load_backbone, resolve, resolve_heads

    try:
        sizes = tuple(sorted({int(s) for s in args.sizes.split(",")}))
    except ValueError:
        raise UserError(f"--sizes must be comma-separated node counts such as 1,8,16, not {args.sizes!r}.") from None
    if sizes[0] < 1 or sizes[-1] > 64 or args.repeats < 1 or args.context < 1:
        raise UserError("--sizes must lie in 1…64, and --repeats and --context be at least 1.")
    spec = resolve(args.model)
    heads_dir = resolve_heads(args.heads) if args.heads else spec.heads_folder
    backbone = load_backbone(args.model, args.dtype, args.device, args.quantization, spec=spec)
    heads, trained = heads_for(backbone, heads_dir)
    model = backbone.model
    line = backbone.tokenizer("Explain, step by step and with an example, how a hash table handles collisions. ")
    context = (line["input_ids"] * (args.context // len(line["input_ids"]) + 1))[: args.context]
    here = profile.machine(model.device)
    dtype = str(model.dtype).removeprefix("torch.")
    print(
        f"profile: {args.model} ({dtype}, {backbone.backend.describe()} forward) on {here.cpu}, "
        f"{here.kernels} kernels, {here.threads} threads",
        file=sys.stderr,
    )
    costs = profile.step_costs(
        backbone.backend,
        context,
        lambda tree: MedusaDrafter(heads, tree),
        sizes,
        args.repeats,
        lambda n: print(f"  {n} nodes…", file=sys.stderr, flush=True),
    )
    floor = profile.row_floor(backbone.backend, costs)
    if args.json:
        report = {
            "model": args.model,
            "dtype": dtype,
            "forward": backbone.backend.describe(),
            "machine": asdict(here),
            "heads": "trained" if trained else "untrained",
            "context": len(context),
            "steps": [asdict(c) for c in costs],
            "relative": {c.nodes: round(c.total_ms / costs[0].total_ms, 3) for c in costs},
            "row_floor": asdict(floor),
        }
        print(json.dumps(report, indent=1))
    else:
        print(profile.table(costs))
        print(profile.floor_line(floor))
    return 0
