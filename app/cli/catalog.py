"""`medusa-chat models` and `medusa-chat download`: the catalog and what is on disk."""

from __future__ import annotations

import argparse
import sys


def run_models(args: argparse.Namespace) -> int:
    from models.catalog import entries
    from models.hub import cached_state

    print(f"{'id':<26}{'download':>10}{'4-bit mem':>11}  {'state':<14}name")
    for e in entries():
        state = "embedded" if e.embedded else cached_state(e.sources)
        size = "—" if e.embedded else f"{e.download_gb:.1f} GB"
        print(f"{e.id:<26}{size:>10}{e.memory_gb_4bit:>8.1f} GB  {state:<14}{e.name}")
    print(
        "Fetch one with `medusa-chat download ID`; any hub repo id or local folder also works with --model.",
        file=sys.stderr,
    )
    return 0


def run_download(args: argparse.Namespace) -> int:
    from models.embedded import EMBEDDED_ID
    from models.loader import resolve

    if args.id == EMBEDDED_ID:
        print(f"{EMBEDDED_ID} is embedded; nothing to download.")
        return 0
    spec = resolve(args.id)
    print(f"{args.id} is ready in {spec.folder}" + (f" (heads in {spec.heads_folder})" if spec.heads_folder else ""))
    return 0
