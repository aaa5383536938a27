"""llama.cpp as a bench peer: the same GGUF file the embedded model ships as, run by
llama-cpp-python (an optional extra, `pip install -e '.[llamacpp]'`, built for this CPU).

Only the bench uses it, to show where our decoding stands against the engine a CPU user would
otherwise pick. The package is imported on demand; when it is missing, `load` says so in one
sentence and returns None so the bench can go on without that mode.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from core.decode.settings import DecodeSettings

Runner = Callable[[list[int], DecodeSettings, tuple[int, ...]], tuple[tuple[int, ...], float, float]]


def load(gguf: Path, threads: int, context: int = 4096) -> Runner | None:
    """A function that answers prompt ids with llama.cpp: (reply ids, seconds, seconds to the first
    token); None if the package is not installed. `context`: the longest prompt and reply it takes."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print(
            "llama.cpp is not installed, so the llamacpp mode is skipped; install it with "
            'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python.',
            file=sys.stderr,
        )
        return None
    llm = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_batch=512, verbose=False)

    def run(
        prompt_ids: list[int], settings: DecodeSettings, eos_ids: tuple[int, ...]
    ) -> tuple[tuple[int, ...], float, float]:
        stop = set(eos_ids) | {llm.token_eos()}
        out: list[int] = []
        llm.reset()  # else `generate` reuses the longest prefix of the last prompt (a bench's shared filler)
        start = first = time.perf_counter()
        tokens = llm.generate(
            prompt_ids, temp=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
            repeat_penalty=1.0, reset=True,
        )  # fmt: skip
        for token in tokens:
            first = first if out else time.perf_counter()  # the prompt read, its first token chosen
            out.append(token)
            if token in stop or len(out) >= settings.max_new_tokens:
                break
        return tuple(out), time.perf_counter() - start, first - start

    return run
