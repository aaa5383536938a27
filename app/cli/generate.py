"""`medusa-chat generate`: answer one prompt, streamed to the terminal or as one JSON object."""

from __future__ import annotations

import argparse
import json
import sys

from app.cli.options import check_seeds, decoding_options, setup
from core.decode.settings import MODES
from core.decode.tree import AUTO
from core.errors import UserError

HELP = "answer one prompt (the reply on stdout; with --json one JSON object)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--mode", default="medusa", choices=MODES, help="medusa: tree decoding")
    p.add_argument(
        "--num-samples", type=int, default=1, help="independent samples (sample i is seeded with --seed + i)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    decoding_options(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from core.decode.generate import Finished, stream

    if not args.prompt.strip():
        raise UserError("The prompt is empty; pass --prompt with some text.")
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {args.num_samples}.")
    check_seeds(args.seed, args.num_samples, "samples")  # sample i is seeded with --seed + i
    settings, backbone, drafters, preset, costs = setup(args, None if args.mode == "medusa" else ())
    drafter = next(iter(drafters.values()), None)
    prompt_ids = backbone.encode_chat(args.prompt, args.system)
    painter = _Painter(enabled=not args.json and sys.stdout.isatty())
    samples = []
    for i in range(args.num_samples):
        # one generator per sample: how many draws a sample's last step spends (it follows the
        # trees the policy picks from timings) must not change the samples after it
        generator = torch.Generator(backbone.model.device).manual_seed(args.seed + i)
        events = stream(
            backbone.backend,
            prompt_ids,
            settings,
            drafter,
            backbone.tokenizer,
            backbone.eos_ids,
            generator,
        )
        steps = []
        for e in events:
            if isinstance(e, Finished):
                done = e
                break
            steps.append(len(e.token_ids))
            if not args.json:
                painter.write(e.text, e.accepted, e.sources)
        samples.append(
            {
                "text": done.text,
                "token_ids": list(done.token_ids),
                "steps": steps,
                "seconds": round(done.seconds, 4),
            }
        )
        if not args.json:
            print(flush=True)
            print(
                f"[{len(done.token_ids)} tokens in {done.steps} steps = "
                f"{done.tokens_per_step:.2f} tokens/step, {done.tokens_per_second:.1f} tokens/s, "
                f"first token {1000 * done.first_token_seconds:.0f} ms, finished by {done.finish_reason}]",
                file=sys.stderr,
            )
    if costs:  # after the reply, never before it: the first launch measures this machine for later ones
        costs.measure()
    if args.json:
        result = {
            "model": args.model,
            "mode": args.mode,
            "drafter": next(iter(drafters), None),
            "tree": args.tree if args.tree == AUTO else preset.name,
            "acceptance": args.acceptance,
            "exactness": done.exactness,  # against plain decoding (core.decode.precision)
            "samples": samples,
        }
        print(json.dumps(result, ensure_ascii=False))
    return 0


class _Painter:
    """Colors each step's text in a terminal: drafted-and-accepted steps stand out, and those
    whose drafts were copied from the conversation or from past replies are also underlined."""

    COLORS = ("\x1b[38;5;39m", "\x1b[38;5;208m", "\x1b[38;5;35m", "\x1b[38;5;170m")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.n = 0

    def write(self, text: str, accepted: int, sources: tuple[str, ...] = ()) -> None:
        if self.enabled and accepted:
            self.n += 1
            underline = "\x1b[4m" if any(s in ("context", "both", "retrieval") for s in sources) else ""
            text = f"{self.COLORS[self.n % len(self.COLORS)]}{underline}{text}\x1b[0m"
        sys.stdout.write(text)
        sys.stdout.flush()
