"""Weight files written so that an interrupted write never leaves a damaged one in place."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor


def save_tensors(file: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
    """`tensors` as safetensors in `file`: written beside it first, then moved into place."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    tmp.replace(file)
