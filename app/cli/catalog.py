"""`medusa-chat models` and `medusa-chat download`: the catalog, what is downloaded and the models
already on this machine (Ollama, LM Studio, the Hugging Face cache)."""

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
    _print_on_disk()
    print(
        "Fetch one with `medusa-chat download ID`; any hub repo id, local folder or .gguf file also works with"
        " --model.",
        file=sys.stderr,
    )
    return 0


def _print_on_disk() -> None:
    """The models already on this machine (Ollama, LM Studio, the hub cache), each with what to pass
    to --model; a damaged or unsupported one with why it cannot be opened."""
    from models import on_disk

    found = on_disk.find()
    print("\nOn this machine")
    if not found:
        print("  none found in Ollama's store, LM Studio's models folder or the Hugging Face cache")
        return
    print(f"  {'name':<44}{'size':>9}  {'quant':<9}{'arch':<10}{'params':>7}  --model")
    for f in found:
        params = on_disk.params_text(f.parameters) if f.parameters else "—"
        quant, arch = f.quantization or "—", f.architecture or "—"
        print(f"  {f.name:<44}{on_disk.size_text(f.size):>9}  {quant:<9}{arch:<10}{params:>7}  {f.ref}")
        if f.problem:
            print(f"  {'':<44}cannot open: {f.problem}")


def run_download(args: argparse.Namespace) -> int:
    from models.embedded import EMBEDDED_ID
    from models.loader import resolve

    if args.id == EMBEDDED_ID:
        print(f"{EMBEDDED_ID} is embedded; nothing to download.")
        return 0
    spec = resolve(args.id)
    print(f"{args.id} is ready in {spec.folder}" + (f" (heads in {spec.heads_folder})" if spec.heads_folder else ""))
    return 0
