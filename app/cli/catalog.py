"""`medusa-chat models` and `medusa-chat download`: the catalog, what is downloaded and the models
already on this machine (Ollama, LM Studio, the Hugging Face cache)."""

from __future__ import annotations

import argparse
import sys

SECTIONS = {
    "cpu": "For a CPU: one GGUF file each, run in 4-bit on the project's kernels",
    "gpu": "For a GPU: a safetensors backbone with published Medusa heads, in 4-bit NF4",
}
HEADER = ("id", "params", "weights", "download", "4-bit mem", "gated", "state", "license", "drafters")


def run_models(args: argparse.Namespace) -> int:
    from models.catalog import entries

    for target, title in SECTIONS.items():
        rows = [_row(e) for e in entries() if e.target == target]
        if rows:
            print(f"{title}\n" if target == "cpu" else f"\n{title}\n", end="")
            _print_table([HEADER, *rows])
    _print_on_disk()
    print(
        "Fetch one with `medusa-chat download ID`; any hub repo id, local folder or .gguf file also works with"
        " --model. Every model also drafts with the lookups; pass an EAGLE-3 repo to --eagle, a draft model to"
        " --draft-model. A gated repo needs its terms accepted on the hub and `hf auth login`.",
        file=sys.stderr,
    )
    return 0


def _row(e) -> tuple[str, ...]:
    from models.hub import cached_state

    state = "embedded" if e.embedded else cached_state(e.sources)
    params = "—" if e.params_b is None else f"{e.params_b:.1f}B" if e.params_b >= 1 else f"{e.params_b * 1000:.0f}M"
    download = "—" if e.embedded else _gb(e.download_gb)
    gated = "yes" if e.gated else "no"
    return e.id, params, e.quantization, download, _gb(e.memory_gb_4bit), gated, state, e.license, e.drafter


def _gb(amount: float) -> str:
    return f"{amount:.1f} GB" if amount >= 1 else f"{amount * 1000:.0f} MB"


def _print_table(rows: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell (numbers right-aligned), the last one left as it is."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    right = {1, 3, 4}  # params, download, memory
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))]
        print("  ".join([*cells, r[-1]]).rstrip())


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
