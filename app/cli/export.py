"""`medusa-chat export`: a model's Medusa heads in the layout vLLM or TGI loads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.errors import UserError

HELP = "write a model's Medusa heads in the layout vLLM or Text Generation Inference serves"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from models.embedded import EMBEDDED_ID
    from models.export import FORMATS

    p.add_argument("out", help="the folder to write (created; files of the same names are replaced)")
    p.add_argument("--format", required=True, choices=FORMATS, help="the serving engine's layout")
    p.add_argument("--model", default=EMBEDDED_ID, help="catalog id, hub repo id or model folder")
    p.add_argument("--heads", help="Medusa heads: a folder or a hub repo id (default: the model's own)")


def run(args: argparse.Namespace) -> int:
    from models.export import check_format, export_heads
    from models.heads import load_heads
    from models.loader import load_backbone, resolve, resolve_heads

    check_format(args.format)  # refused before anything loads
    spec = resolve(args.model)
    heads_dir = resolve_heads(args.heads) if args.heads else spec.heads_folder
    if heads_dir is None:
        raise UserError(f"{args.model} has no Medusa heads to export; pass --heads FOLDER or train some first.")
    # the projection at full precision, whatever the CPU would pick for decoding
    backbone = load_backbone(args.model, "float32", "cpu", "none", spec=spec)
    lm_head = backbone.model.get_output_embeddings()
    heads = load_heads(heads_dir, lm_head, backbone.name)
    out = Path(args.out).expanduser()
    command = export_heads(heads, lm_head.weight, out, args.format, str(spec.folder))
    print(f"Heads written to {out} for {args.format}. Serve them with:", file=sys.stderr)
    print(command)
    return 0
