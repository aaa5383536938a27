"""What /proc/cpuinfo says of this CPU (its first processor): the kernels' availability checks and
the machine a measurement names."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = (line.partition(":") for line in text.split("\n\n")[0].splitlines())
    return {k.strip(): v.strip() for k, _, v in fields}


def cpu_flags() -> set[str]:
    """The CPU's feature flags ("avx512f", "amx_bf16"…)."""
    return set(cpu_fields().get("flags", "").split())
