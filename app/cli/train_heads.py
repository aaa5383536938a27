"""`medusa-chat train-heads`: Medusa heads for a model, by self-distillation."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.cli.options import answer_prompts, model_options, read_prompts, seed, writable
from core.errors import UserError

HELP = "train Medusa heads for a model by self-distillation"


def add_arguments(p: argparse.ArgumentParser) -> None:
    model_options(p, heads=False)
    p.add_argument("--prompts", required=True, help='JSONL seed prompts, one {"prompt": ...} per line')
    p.add_argument("--out", required=True, help="folder for the trained heads")
    p.add_argument("--work-dir", help="transcripts go here (default: OUT/data); a rerun resumes")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    p.add_argument("--own-lm-head", action="store_true", help="a vocabulary projection per head (large)")
    p.add_argument(
        "--full-vocab",
        action="store_true",
        help="shared heads read out over the whole vocabulary (default: the tokens the model wrote in the transcripts)",
    )
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--decay", type=float, default=0.8, help="loss weight λ^k of head k")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generation batch")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--seed", type=seed, default=0)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from core.train import heads as train
    from models.heads import MedusaHeads
    from models.loader import load_backbone

    if not 1 <= args.num_heads <= 8 or not 1 <= args.layers <= 4:
        raise UserError("--num-heads must be 1 to 8 and --layers 1 to 4.")
    if args.epochs < 1 or not 0 < args.decay <= 1 or args.lr <= 0:
        raise UserError("--epochs must be ≥ 1, --decay in (0, 1] and --lr > 0.")
    prompts = read_prompts(args.prompts)
    out = writable(Path(args.out).expanduser(), "--out", folder=True)  # before the model loads and training starts
    work = writable(Path(args.work_dir).expanduser(), "--work-dir", folder=True) if args.work_dir else out / "data"
    backbone = load_backbone(args.model, args.dtype, args.device, args.quantization)
    model = backbone.model

    # 1) self-distillation (resumable)
    transcripts = work / "transcripts.jsonl"
    answer_prompts(backbone, prompts, transcripts, args.batch_size, args.max_new_tokens)
    records = train.read_records(transcripts)

    # 2) hidden states, once, cached next to the transcripts
    cached = work / "features.safetensors"
    key = train.transcripts_key(records)
    data = train.Features.load(cached, key, args.num_heads)
    if data is None:
        data = train.features(
            model, records, args.num_heads, lambda rs: tqdm(rs, desc="hidden states", unit="transcript")
        )
        data.save(cached, key)

    # 3) training; the epoch with the lowest held-out loss is kept
    lm_head = model.get_output_embeddings()
    for p in lm_head.parameters():
        p.requires_grad_(False)
    vocab, hidden = lm_head.out_features, lm_head.in_features
    subset = None
    if not args.own_lm_head and not args.full_vocab:
        subset = torch.unique(data.targets[data.targets >= 0])  # every token the model wrote
        print(f"heads read out over the {len(subset)} tokens the model wrote (of {vocab})", file=sys.stderr)
    with torch.random.fork_rng(devices=[]):  # seeded initial weights, torch's own generator left as it was
        torch.manual_seed(args.seed)
        heads = MedusaHeads(hidden, vocab, args.num_heads, args.layers, None if args.own_lm_head else lm_head, subset)
    heads = heads.to(device=model.device, dtype=torch.float32)
    targets = heads.target_index(data.targets.to(model.device))
    data = train.Features(data.hidden.to(model.device), targets, data.source)
    result, best, result_step = None, None, 0
    n_train = len(train.split(len(data.hidden), 0.1, args.seed, data.source)[0])
    total = args.epochs * train.batches_per_epoch(n_train, 256)
    with tqdm(total=total, desc="training heads", unit="batch") as bar:
        for step, loss, accuracy in train.train(heads, data, args.epochs, args.lr, args.decay, seed=args.seed):
            if accuracy is None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")
                continue
            top1 = " ".join(f"{a:.2f}" for a in accuracy.top1)
            bar.write(f"after step {step}: held-out top-1 per head {top1}, loss {accuracy.loss:.3f}")
            if result is None or accuracy.loss < result.loss:
                result, best, result_step = accuracy, {k: v.clone() for k, v in heads.state_dict().items()}, step
    heads.load_state_dict(best)
    heads.to(dtype=model.dtype).save(out, base_model=args.model)
    card = {
        "base_model": args.model, "prompts": len(prompts), "transcripts": len(records),
        "positions": len(data.hidden), "num_heads": args.num_heads, "layers": args.layers,
        "shared_lm_head": not args.own_lm_head, "vocab_subset": None if subset is None else len(subset),
        "epochs": args.epochs, "lr": args.lr, "decay": args.decay,
        "max_new_tokens": args.max_new_tokens, "dtype": str(model.dtype).removeprefix("torch."),
        "optimizer_steps": result_step, "held_out_top1": list(result.top1), "held_out_top5": list(result.top5),
    }  # fmt: skip
    (out / "training.json").write_text(json.dumps(card, indent=1) + "\n", encoding="utf-8")
    (out / "README.md").write_text(_heads_card(card, result_step), encoding="utf-8")
    print(
        f"heads saved in {out}; held-out top-1 per head: {', '.join(f'{a:.2f}' for a in result.top1)}", file=sys.stderr
    )
    return 0


def _heads_card(card: dict, steps: int) -> str:
    """A short human-readable card for a heads folder (the numbers are in training.json)."""
    rows = "\n".join(
        f"| {k + 1} | t+{k + 2} | {t1:.3f} | {t5:.3f} |"
        for k, (t1, t5) in enumerate(zip(card["held_out_top1"], card["held_out_top5"], strict=True))
    )
    vocab = f", read out over the {card['vocab_subset']} tokens the model wrote" if card.get("vocab_subset") else ""
    return (
        f"# Medusa heads for {card['base_model']}\n\n"
        f"Medusa-1 heads ({card['num_heads']} heads, {card['layers']} residual block each, "
        f"{'shared' if card['shared_lm_head'] else 'own'} lm_head{vocab}), trained by `medusa-chat train-heads` "
        f"with the backbone frozen ({card['dtype']}).\n\n"
        f"- Data: {card['prompts']} seed prompts answered greedily by the model itself (up to "
        f"{card['max_new_tokens']} new tokens): {card['transcripts']} transcripts, {card['positions']} positions; "
        "whole transcripts held out for evaluation.\n"
        f"- Training: loss Σ {card['decay']}^k·CE, AdamW lr {card['lr']}, {card['epochs']} epochs; the kept "
        f"weights are those after optimizer step {steps} (lowest held-out loss).\n\n"
        "| head | predicts | held-out top-1 | held-out top-5 |\n|---|---|---|---|\n"
        f"{rows}\n"
    )
