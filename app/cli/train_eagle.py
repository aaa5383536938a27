"""`medusa-chat train-drafter --kind eagle`: the EAGLE draft layer trained on the model's own
replies (the transcripts train-drafter has answered), with a card of its held-out acceptance."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def train_eagle(
    args: argparse.Namespace, backbone, prompts: list[str], records: list[dict], work: Path, out: Path,
    answered: int, answering: float,
) -> int:  # fmt: skip
    from tqdm.auto import tqdm

    from core.drafters.eagle import DrafterCard, EagleDraft, eagle3_taps, init_from_backbone, save_draft
    from core.train import eagle as eagle_train
    from core.train import heads as train
    from core.train import replies
    from models.stock import load_stock

    stock = load_stock(backbone, torch.bfloat16)  # batched features: bf16 on unpacked weights is fastest
    layers = stock.config.get_text_config().num_hidden_layers
    taps = eagle3_taps(layers) if args.features == "eagle3" else ()
    started = time.perf_counter()
    with tqdm(total=len(records), desc="features", unit="reply") as bar:
        seqs = eagle_train.features(
            stock, records, work / "features", progress=lambda done, total: bar.update(done - bar.n), taps=taps
        )
    featuring = time.perf_counter() - started
    by_index = {r["index"]: s for r, s in zip(records, seqs, strict=True)}
    kept, held = replies.split(records, args.held_out, args.seed)
    train_seqs = [by_index[r["index"]] for r in kept]
    held_seqs = [by_index[r["index"]] for r in held]
    sampled, sampling, sampled_features = _sampled(
        args, backbone, stock, prompts, work, [r["index"] for r in kept], taps
    )
    train_seqs += [s for _, s in sampled]
    answering, featuring = answering + sampling, featuring + sampled_features
    vocab = eagle_train.draft_vocab(kept + [r for r, _ in sampled], args.draft_vocab)
    draft = EagleDraft(stock, vocab, taps=taps)
    init_from_backbone(draft, stock)
    draft.float()
    total = eagle_train.total_batches(train_seqs, args.epochs, args.seed)
    started = time.perf_counter()
    with tqdm(total=total, desc="training the EAGLE layer", unit="batch") as bar:

        def epoch_done(epoch: int, result: dict) -> None:
            accept = ", ".join(f"{a:.2f}" for a in result["acceptance"])
            bar.write(
                f"epoch {epoch}: held-out acceptance by depth {accept}; chain {result['chain_tokens_per_step']:.2f}",
                file=sys.stderr,
            )

        def step(batches: int, loss: float) -> None:
            bar.update(batches)
            if loss == loss:  # not the NaN of batches a resumed run skips
                bar.set_postfix(loss=f"{loss:.3f}")

        result, best_epoch = eagle_train.fit(
            draft, train_seqs, held_seqs, args.epochs, args.lr, args.passes, work / "eagle", seed=args.seed,
            progress=step, on_epoch=epoch_done,
        )  # fmt: skip
    training = time.perf_counter() - started
    vocab_size = backbone.model.get_output_embeddings().out_features
    hidden = backbone.model.config.get_text_config().hidden_size
    save_draft(out, draft, DrafterCard(args.model, vocab_size, hidden, tuple(result["acceptance"])))
    in_vocab = set(vocab.tolist())
    held_tokens = [t for r in held for t in r["answer_ids"]]
    coverage = sum(t in in_vocab for t in held_tokens) / max(1, len(held_tokens))
    card = {
        "model": args.model, "kind": "eagle", "prompts": len(records), "replies_trained": len(kept),
        "replies_held_out": len(held), "samples": args.samples, "sampled_replies": len(sampled),
        "sampling": {"temperature": train.SAMPLED.temperature, "top_p": train.SAMPLED.top_p},
        "train_tokens": sum(len(r["answer_ids"]) for r in kept) + sum(len(r["answer_ids"]) for r, _ in sampled),
        "draft_vocab": len(vocab), "held_out_vocab_coverage": round(coverage, 4), "taps": list(taps),
        "epochs": args.epochs, "best_epoch": best_epoch, "passes": args.passes, "lr": args.lr,
        "answered_this_run": answered, "answering_seconds": round(answering), "feature_seconds": round(featuring),
        "training_seconds": round(training), "threads": torch.get_num_threads(), "held_out": result,
        "parameters": sum(p.numel() for n, p in draft.named_parameters()), "file_bytes": out.stat().st_size,
    }  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(card, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(_card(card), encoding="utf-8")
    print(f"EAGLE drafter saved in {out}: held-out acceptance by depth {result['acceptance']}", file=sys.stderr)
    return 0


def _sampled(
    args: argparse.Namespace, backbone, stock, prompts: list[str], work: Path, kept: list[int], taps: tuple[int, ...]
) -> tuple[list[tuple[dict, object]], float, float]:
    """The `--samples` sampled replies to each kept prompt with their features (the model's
    argmax as each position's token target); the seconds sampling and features took."""
    from tqdm.auto import tqdm

    from app.cli.options import answer_prompts
    from core.train import eagle as eagle_train
    from core.train import heads as train

    out, sampling, featuring, wanted = [], 0.0, 0.0, set(kept)
    for k in range(1, args.samples + 1):
        file = work / f"sampled-{k}.jsonl"
        started = time.perf_counter()
        answer_prompts(backbone, prompts, file, args.batch_size, args.max_new_tokens, k, kept)
        sampling += time.perf_counter() - started
        records = sorted((r for r in train.read_records(file) if r["index"] in wanted), key=lambda r: r["index"])
        started = time.perf_counter()
        with tqdm(total=len(records), desc=f"features (sampled {k})", unit="reply") as bar:
            seqs = eagle_train.features(
                stock, records, work / f"features-sampled-{k}", taps=taps, targets=True,
                progress=lambda done, total: bar.update(done - bar.n),
            )  # fmt: skip
        featuring += time.perf_counter() - started
        out += list(zip(records, seqs, strict=True))
    return out, sampling, featuring


def _card(card: dict) -> str:
    held = card["held_out"]
    depths = "\n".join(f"| {d} | {a:.3f} |" for d, a in enumerate(held["acceptance"], 1))
    return (
        f"# EAGLE drafter for {card['model']}\n\n"
        "One decoder layer of the model's own architecture on fc([feature; token embedding]), read out "
        f"with the model's lm_head (the feature: {_reads(card.get('taps', []))}) over its "
        f"{card['draft_vocab']} most written tokens "
        f"({card['held_out_vocab_coverage']:.1%} of held-out reply tokens), made by "
        "`medusa-chat train-drafter --kind eagle`.\n\n"
        f"- Data: the model's greedy replies to {card['prompts']} seed prompts; {card['replies_trained']} train, "
        f"{card['replies_held_out']} held out{_samples(card)}; {card['train_tokens']} reply tokens to train on.\n"
        f"- Training: {card['epochs']} epochs ({card['passes']} draft depths trained together, EAGLE-3's "
        f"training-time test), best epoch {card['best_epoch']}; in the last run features took "
        f"{card['feature_seconds']} s (chunks an earlier run made are reused) and training "
        f"{card['training_seconds']} s on {card['threads']} CPU threads. A rerun resumes after the last finished "
        "epoch.\n"
        f"- {card['parameters']:,} parameters, {card['file_bytes'] / 1e6:.1f} MB (bf16).\n\n"
        "Held-out chain acceptance by depth (depth k given depths before it right), at temperature 0:\n\n"
        f"| depth | accepted |\n|---|---|\n{depths}\n\n"
        f"A chain of {len(held['acceptance'])} would give {held['chain_tokens_per_step']:.2f} tokens per step; "
        "the dynamic tree gives more (see `medusa-chat bench`).\n"
    )


def _samples(card: dict) -> str:
    if not card.get("samples"):
        return ""
    return (
        f", and {card['sampled_replies']} replies sampled (temperature {card['sampling']['temperature']}, top-p "
        f"{card['sampling']['top_p']}; {card['samples']} per training prompt), whose positions learn the model's "
        "greedy token"
    )


def _reads(taps: list[int]) -> str:
    if not taps:
        return "the model's last hidden state"
    return (
        f"its last hidden state fused with the streams after layers {', '.join(map(str, taps))}, EAGLE-3's "
        "multi-layer features"
    )
