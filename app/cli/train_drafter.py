"""`medusa-chat train-drafter`: a drafter for a model from its own replies to seed prompts."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from app.cli.options import answer_prompts, model_options, read_prompts, seed, writable
from core.errors import UserError

HELP = (
    "build a drafter for a model from its own replies (--kind retrieval: an index of past replies; "
    "eagle: a trained EAGLE draft layer)"
)
KINDS = ("retrieval", "eagle")
FEATURES = ("eagle3", "last")  # the EAGLE draft's inputs: multi-layer (the default) or the last layer


def add_arguments(p: argparse.ArgumentParser) -> None:
    model_options(p, heads=False)
    p.add_argument(
        "--kind",
        choices=KINDS,
        default="retrieval",
        help="retrieval: a suffix index of the replies; eagle: a draft layer",
    )
    p.add_argument("--prompts", required=True, help='JSONL seed prompts, one {"prompt": ...} per line')
    p.add_argument("--out", required=True, help="the corpus file to write (.safetensors; a card goes beside it)")
    p.add_argument("--work-dir", help="transcripts go here (default: beside OUT); a rerun resumes")
    p.add_argument("--held-out", type=float, default=0.1, help="share of replies kept out to measure the drafter")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generation batch")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=seed, default=0)
    eagle = p.add_argument_group("eagle")
    eagle.add_argument("--epochs", type=int, default=4)
    eagle.add_argument("--lr", type=float, default=1e-3)
    eagle.add_argument("--passes", type=int, default=3, help="training-time test: draft depths trained together")
    eagle.add_argument("--draft-vocab", type=int, default=8192, help="tokens the draft reads out over")
    eagle.add_argument(
        "--samples",
        type=int,
        default=0,
        help="replies sampled per training prompt beside the greedy one (more varied data; positions learn the "
        "model's greedy token)",
    )
    eagle.add_argument(
        "--features",
        choices=FEATURES,
        default=FEATURES[0],
        help="what the draft reads at committed positions: eagle3 fuses three layers' streams (low, middle, "
        "high) with the last feature; last reads the last feature only (EAGLE-1/2)",
    )


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from core.drafters.retrieval import save_corpus
    from core.train import heads as train
    from core.train import replies
    from models.loader import load_backbone

    if not 0 < args.held_out < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise UserError("--held-out must be between 0 and 1, and --batch-size and --max-new-tokens at least 1.")
    if args.kind == "eagle" and (args.epochs < 1 or args.passes < 1 or args.draft_vocab < 2 or args.samples < 0):
        raise UserError("--epochs and --passes must be at least 1, --draft-vocab at least 2 and --samples at least 0.")
    out = Path(args.out).expanduser()
    if out.suffix != ".safetensors":
        raise UserError(f"--out must name a .safetensors file, not {out}.")
    prompts = read_prompts(args.prompts)
    writable(out, "--out")  # before the model loads and training starts
    work = Path(args.work_dir).expanduser() if args.work_dir else out.with_suffix("")
    writable(work, "--work-dir", folder=True)
    backbone = load_backbone(args.model, args.dtype, args.device, args.quantization)

    transcripts = work / "transcripts.jsonl"  # the same self-distillation as train-heads, resumable
    started = time.perf_counter()
    answered = answer_prompts(backbone, prompts, transcripts, args.batch_size, args.max_new_tokens)
    answering = time.perf_counter() - started
    records = sorted(train.read_records(transcripts), key=lambda r: r["index"])  # reply i answers prompt i

    if args.kind == "eagle":
        from app.cli.train_eagle import train_eagle

        return train_eagle(args, backbone, prompts, records, work, out, answered, answering)
    kept, held = replies.split(records, args.held_out, args.seed)
    corpus, _ = replies.build(kept)
    with tqdm(total=len(held), desc="replaying held-out replies", unit="reply") as bar:
        result = replies.evaluate(corpus, held, progress=lambda done, total: bar.update(done - bar.n))
    full, seconds = replies.build(records)  # what ships holds every reply
    vocab = backbone.model.get_output_embeddings().out_features
    rates = [h["hit_rate"] for h in result["first_token_hits"]]
    save_corpus(out, [r["answer_ids"] for r in records], args.model, vocab, rates)
    card = {
        "model": args.model, "kind": args.kind, "prompts": len(prompts), "replies": len(records),
        "tokens": len(full), "index_bytes": full.nbytes, "index_seconds": round(seconds, 3),
        "max_new_tokens": args.max_new_tokens, "dtype": str(backbone.model.dtype).removeprefix("torch."),
        "answered_this_run": answered, "answering_seconds": round(answering), "held_out": result,
    }  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(card, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(_card(card), encoding="utf-8")
    tau = result["tokens_per_step"]
    print(
        f"corpus saved in {out}: {len(full)} tokens; held-out tokens per step: "
        + ", ".join(f"{k} {v:.2f}" for k, v in tau.items()),
        file=sys.stderr,
    )
    return 0


def _card(card: dict) -> str:
    """A short human-readable card for a reply corpus (the numbers are in the .json beside it)."""
    held = card["held_out"]
    tau = "\n".join(f"| {k} | {v:.3f} |" for k, v in held["tokens_per_step"].items())
    rate = lambda h: "—" if h["hit_rate"] is None else f"{h['hit_rate']:.2f}"  # noqa: E731
    hits = "\n".join(f"| {h['class']} | {h['lookups']} | {rate(h)} |" for h in held["first_token_hits"])
    return (
        f"# Reply corpus for {card['model']} (retrieval drafting)\n\n"
        f"The model's own greedy replies ({card['dtype']}, up to {card['max_new_tokens']} new tokens) to "
        f"{card['prompts']} seed prompts, made by `medusa-chat train-drafter --kind retrieval`: "
        f"{card['replies']} replies, {card['tokens']} tokens ({card['answered_this_run']} answered in the last run, "
        f"in {card['answering_seconds']} s; a run resumes where an interrupted one stopped), in the order of "
        "the prompts file, so reply i answers prompt i.\n\n"
        f"- Index: a suffix array, built at load in {card['index_seconds']:.2f} s on the machine that made it; "
        f"{card['index_bytes'] / 1e6:.1f} MB in memory.\n"
        f"- Lookup: {held['lookup_ms']:.3f} ms a step (the longest suffix of the history found, then the most "
        "frequent continuation of it).\n"
        f"- Held out: {held['replies']} replies ({held['tokens']} tokens) not in the index while measuring, "
        "replayed as greedy decoding meets them (each step accepts the longest prefix a draft shares with the "
        "reply, plus one token); the lookups use 1 branch, the context's continuations 4 tokens and the "
        "retrieval's 8.\n\n"
        f"| drafter | tokens per step |\n|---|---|\n{tau}\n\n"
        "The retrieval's first drafted token, by how strongly the corpus backs it (class 0: under a quarter of "
        "the occurrences go on with it … 3: three quarters or more, by one or two; 4: by more):\n\n"
        f"| class | lookups | right |\n|---|---|---|\n{hits}\n"
    )
