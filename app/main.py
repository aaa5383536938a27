"""The `medusa-chat` command line: `generate`, `bench` (and the chat UI later).

Every mistake a user can make ends here as one sentence on stderr and exit status 2; an
unexpected failure prints one sentence and leaves the traceback in the log file.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

import platformdirs

from core.errors import UserError

log = logging.getLogger("medusa-chat")


def _model_options(p: argparse.ArgumentParser, heads: bool = True) -> None:
    """Which model (and heads) to load, and how: shared by every command that loads one."""
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalog id, hub repo id or model folder")
    if heads:
        p.add_argument("--heads", help="Medusa heads: a folder or a hub repo id (default: the model's own)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "nf4", "int8"],
        help="auto: 4-bit nf4 on a GPU, none on a CPU",
    )


def _decoding_options(p: argparse.ArgumentParser) -> None:
    _model_options(p)
    p.add_argument("--acceptance", default="lossless", choices=["lossless", "typical"])
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--epsilon", type=float, default=0.09, help="typical: probability threshold ε")
    p.add_argument("--delta", type=float, default=0.3, help="typical: entropy threshold δ")
    p.add_argument("--tree", help="tree preset name or JSON file (default: the model's)")
    p.add_argument(
        "--drafter",
        choices=["medusa", "lookup", "hybrid"],
        help="medusa: heads; lookup: copies from the conversation; hybrid: both in one tree (default: the tree's)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="medusa-chat", description=__doc__.splitlines()[0])
    sub = root.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="answer one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", help="system prompt")
    gen.add_argument("--mode", default="medusa", choices=["medusa", "baseline"], help="medusa: tree decoding")
    gen.add_argument("--num-samples", type=int, default=1, help="independent samples (seeded from --seed)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _decoding_options(gen)

    bench = sub.add_parser("bench", help="compare decoding modes on a prompt file")
    bench.add_argument("--prompts", required=True, help='JSONL file, one {"prompt": ...} per line')
    bench.add_argument(
        "--modes",
        help="comma-separated: medusa, lookup, hybrid (tree decoding with that drafter), baseline (our plain "
        "loop), hf, hf-pld (transformers generate, plain and prompt lookup); default: drafter,baseline,hf,hf-pld",
    )
    bench.add_argument("--system", help="system prompt for every prompt")
    bench.add_argument("--json", dest="json_out", metavar="OUT", help="write the results here")
    _decoding_options(bench)
    bench.set_defaults(max_new_tokens=128)

    ui = sub.add_parser("ui", help="open the chat in the browser (the default command)")
    ui.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: this machine only)")
    ui.add_argument("--port", type=int, default=None, help="port (default: 7860 or the next free one)")
    ui.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    _model_options(ui)

    train = sub.add_parser("train-heads", help="train Medusa heads for a model by self-distillation")
    _model_options(train, heads=False)
    train.add_argument("--prompts", required=True, help='JSONL seed prompts, one {"prompt": ...} per line')
    train.add_argument("--out", required=True, help="folder for the trained heads")
    train.add_argument("--work-dir", help="transcripts go here (default: OUT/data); a rerun resumes")
    train.add_argument("--num-heads", type=int, default=4)
    train.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    train.add_argument("--own-lm-head", action="store_true", help="a vocabulary projection per head (large)")
    train.add_argument(
        "--full-vocab",
        action="store_true",
        help="shared heads read out over the whole vocabulary (default: the tokens the model wrote in the transcripts)",
    )
    train.add_argument("--epochs", type=int, default=5)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--decay", type=float, default=0.8, help="loss weight λ^k of head k")
    train.add_argument("--batch-size", type=int, default=32, help="prompts per generation batch")
    train.add_argument("--max-new-tokens", type=int, default=160)
    train.add_argument("--seed", type=int, default=0)

    sub.add_parser("models", help="list the model catalog and what is downloaded")
    cal = sub.add_parser(
        "calibrate", help="measure the heads and this machine; write the tree preset that decodes fastest"
    )
    _model_options(cal)
    cal.add_argument("--prompts", help="JSONL calibration prompts (default: the shipped calibration set)")
    cal.add_argument("--max-prompts", type=int, default=60, help="use at most this many prompts")
    cal.add_argument("--max-new-tokens", type=int, default=128)
    cal.add_argument("--budgets", default="0,1,2,3,4,6,8,10,12,16,20,24,32,48,64", help="tree sizes to try")
    cal.add_argument("--out", help="preset file to write (default: ./MODEL-calibrated.json)")

    download = sub.add_parser("download", help="fetch a catalog model (backbone and heads)")
    download.add_argument("id", help="catalog id (see `medusa-chat models`) or hub repo id")
    return root


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv or ["ui"])
    _setup_logging()
    try:
        commands = {
            "generate": _generate,
            "bench": _bench,
            "models": _models,
            "download": _download,
            "ui": _ui,
            "train-heads": _train_heads,
            "calibrate": _calibrate,
        }
        return commands[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:
        log.error("unexpected failure\n%s", traceback.format_exc())
        print(f"error: unexpected {type(e).__name__}: {e} (details in {_log_file()})", file=sys.stderr)
        return 1


def _log_file() -> Path:
    return Path(platformdirs.user_log_dir("medusa-chat")) / "medusa-chat.log"


def _setup_logging() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own messages say what is loading
    hf_logging.set_verbosity_error()
    file = _log_file()
    file.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=file, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")


def _settings(args: argparse.Namespace):
    from core.settings import DecodeSettings

    return DecodeSettings(
        acceptance=args.acceptance,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        epsilon=args.epsilon,
        delta=args.delta,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
    )


def _setup(args: argparse.Namespace, kinds: tuple[str, ...] | None):
    """Validate cheap things first, then load: (settings, backbone, {drafter kind: drafter}, preset).

    `kinds` None means the drafter chosen by --drafter or, failing that, by the tree preset."""
    from core.drafters import make_drafter
    from core.tree import load_preset, preset_names
    from models.loader import heads_for, load_backbone, resolve, resolve_heads

    settings = _settings(args)
    chosen = load_preset(args.tree) if args.tree else None  # a bad tree is refused before any download
    spec = resolve(args.model)
    preset = chosen or load_preset(spec.tree if spec.tree in preset_names() else "cpu-16")
    kinds = kinds if kinds is not None else (args.drafter or preset.drafter,)
    need_heads = any(k in ("medusa", "hybrid") for k in kinds)
    heads_dir = (resolve_heads(args.heads) if args.heads else spec.heads_folder) if need_heads else None
    backbone = load_backbone(args.model, args.dtype, args.device, args.quantization, spec=spec)
    heads = None
    if need_heads:
        heads, trained = heads_for(backbone, heads_dir, num_heads=max(preset.tree.max_depth, 4))
        if not trained:
            print(
                "warning: no trained Medusa heads for this model, so drafts are rarely accepted; pass --heads FOLDER.",
                file=sys.stderr,
            )
    tree = preset.tree.to(backbone.model.device)
    drafters = {
        k: make_drafter(k, heads, tree, f"Tree '{preset.name}'", preset.lookup_branches, preset.lookup_length)
        for k in kinds
    }
    return settings, backbone, drafters, preset


def _generate(args: argparse.Namespace) -> int:
    import torch

    from core.generate import Finished, stream

    if not args.prompt.strip():
        raise UserError("The prompt is empty; pass --prompt with some text.")
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {args.num_samples}.")
    settings, backbone, drafters, preset = _setup(args, None if args.mode == "medusa" else ())
    drafter = next(iter(drafters.values()), None)
    prompt_ids = backbone.encode_chat(args.prompt, args.system)
    generator = torch.Generator(backbone.model.device).manual_seed(args.seed)
    painter = _Painter(enabled=not args.json and sys.stdout.isatty())
    samples = []
    for _ in range(args.num_samples):
        events = stream(
            backbone.model,
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
    if args.json:
        result = {
            "model": args.model,
            "mode": args.mode,
            "drafter": next(iter(drafters), None),
            "tree": preset.name,
            "acceptance": args.acceptance,
            "samples": samples,
        }
        print(json.dumps(result, ensure_ascii=False))
    return 0


class _Painter:
    """Colors each step's text in a terminal: drafted-and-accepted steps stand out, and those
    whose drafts were copied from the conversation are also underlined."""

    COLORS = ("\x1b[38;5;39m", "\x1b[38;5;208m", "\x1b[38;5;35m", "\x1b[38;5;170m")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.n = 0

    def write(self, text: str, accepted: int, sources: tuple[str, ...] = ()) -> None:
        if self.enabled and accepted:
            self.n += 1
            underline = "\x1b[4m" if any(s in ("context", "both") for s in sources) else ""
            text = f"{self.COLORS[self.n % len(self.COLORS)]}{underline}{text}\x1b[0m"
        sys.stdout.write(text)
        sys.stdout.flush()


def _read_prompts(file: str) -> list[str]:
    path = Path(file).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Cannot read the prompt file {path} ({e.__class__.__name__}); check the path.") from e
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f'Line {n} of {path} is not a JSON object with a "prompt"; fix that line.') from None
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f'Line {n} of {path} has an empty "prompt"; fill it or remove the line.')
        prompts.append(prompt)
    if not prompts:
        raise UserError(f'{path} holds no prompts; add lines like {{"prompt": "Hello"}}.')
    return prompts


def _bench(args: argparse.Namespace) -> int:
    from core.bench import TREE_MODES, check_modes, run_bench, speedups, summarize, table
    from core.tree import load_preset

    if args.modes:
        modes = check_modes(args.modes.split(","))
    else:
        default = args.drafter or (load_preset(args.tree).drafter if args.tree else None)
        modes = (default or "default", "baseline", "hf", "hf-pld")
    prompts = _read_prompts(args.prompts)
    settings, backbone, drafters, preset = _setup(args, tuple(m for m in modes if m in TREE_MODES) or None)
    if "default" in modes:  # the model's own drafter
        modes = (next(iter(drafters)), *modes[1:])
    encoded = [backbone.encode_chat(p, args.system) for p in prompts]
    print(
        f"bench: {len(prompts)} prompts × {', '.join(modes)} on {args.model} ({backbone.model.dtype})",
        file=sys.stderr,
    )

    def progress(run) -> None:
        print(
            f"  prompt {run.prompt + 1:>3} {run.mode:<9} {run.tokens:>4} tokens "
            f"{run.steps:>4} steps {run.seconds:6.2f} s",
            file=sys.stderr,
        )

    runs = run_bench(encoded, modes, backbone.model, settings, drafters, backbone.eos_ids, args.seed, progress)
    summary = summarize(runs)
    print(table(summary))
    if args.json_out:
        report = {
            "model": args.model,
            "dtype": str(backbone.model.dtype).removeprefix("torch."),
            "tree": preset.name,
            "lookup": {"branches": preset.lookup_branches, "length": preset.lookup_length},
            "settings": asdict(settings),
            "prompts": len(prompts),
            "summary": {m: asdict(s) for m, s in summary.items()},
            "speedup": speedups(summary, modes[0]),
            "speedups": {m: speedups(summary, m) for m in modes if m in TREE_MODES},
            "runs": [asdict(r) for r in runs],
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def _models(args: argparse.Namespace) -> int:
    from models.catalog import entries
    from models.hub import cached_state

    print(f"{'id':<26}{'download':>10}{'4-bit mem':>11}  {'state':<14}name")
    for e in entries():
        state = "embedded" if e.embedded else cached_state([s for s in (e.backbone, e.heads, e.tokenizer) if s])
        size = "—" if e.embedded else f"{e.download_gb:.1f} GB"
        print(f"{e.id:<26}{size:>10}{e.memory_gb_4bit:>8.1f} GB  {state:<14}{e.name}")
    print("\nFetch one with `medusa-chat download ID`; any hub repo id or local folder also works with --model.")
    return 0


def _download(args: argparse.Namespace) -> int:
    from models.embedded import EMBEDDED_ID
    from models.loader import resolve

    if args.id == EMBEDDED_ID:
        print(f"{EMBEDDED_ID} is embedded; nothing to download.")
        return 0
    spec = resolve(args.id)
    print(f"{args.id} is ready in {spec.folder}" + (f" (heads in {spec.heads_folder})" if spec.heads_folder else ""))
    return 0


def _train_heads(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from core import train
    from models.heads import MedusaHeads
    from models.loader import load_backbone

    if not 1 <= args.num_heads <= 8 or not 1 <= args.layers <= 4:
        raise UserError("--num-heads must be 1 to 8 and --layers 1 to 4.")
    if args.epochs < 1 or not 0 < args.decay <= 1 or args.lr <= 0:
        raise UserError("--epochs must be ≥ 1, --decay in (0, 1] and --lr > 0.")
    prompts = _read_prompts(args.prompts)
    out = Path(args.out).expanduser()
    work = Path(args.work_dir).expanduser() if args.work_dir else out / "data"
    backbone = load_backbone(args.model, args.dtype, args.device, args.quantization)
    model, tokenizer = backbone.model, backbone.tokenizer
    encoded = [backbone.encode_chat(p) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else backbone.eos_ids[0]

    # 1) self-distillation (resumable)
    transcripts = work / "transcripts.jsonl"
    with tqdm(total=len(prompts), desc="answering prompts", unit="prompt") as bar:
        bar.update(train.done_records(transcripts))

        def advance(done: int, total: int) -> None:
            bar.update(done - bar.n)

        train.distill(model, encoded, transcripts, backbone.eos_ids, pad, args.batch_size, args.max_new_tokens, advance)
    records = train.read_records(transcripts)

    # 2) hidden states, once, cached next to the transcripts
    cached = work / "features.safetensors"
    data = train.Features.load(cached, len(records), args.num_heads)
    if data is None:
        data = train.features(
            model, records, args.num_heads, lambda rs: tqdm(rs, desc="hidden states", unit="transcript")
        )
        data.save(cached, len(records))

    # 3) training; the epoch with the lowest held-out loss is kept
    lm_head = model.get_output_embeddings()
    for p in lm_head.parameters():
        p.requires_grad_(False)
    vocab, hidden = lm_head.weight.shape
    torch.manual_seed(args.seed)
    subset = None
    if not args.own_lm_head and not args.full_vocab:
        subset = torch.unique(data.targets[data.targets >= 0])  # every token the model wrote
        print(f"heads read out over the {len(subset)} tokens the model wrote (of {vocab})", file=sys.stderr)
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
    print(f"heads saved in {out}; held-out top-1 per head: {', '.join(f'{a:.2f}' for a in result.top1)}")
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


LOOKUP_SETTINGS = ((1, 4), (2, 4), (3, 4), (1, 6), (2, 6), (3, 6), (4, 8))  # (branches, length) tried


def _calibrate(args: argparse.Namespace) -> int:
    from importlib import resources

    import torch
    from tqdm.auto import tqdm

    from core import calibrate as cal
    from core import train
    from core.drafters import LookupDrafter, MedusaDrafter
    from core.settings import DecodeSettings
    from core.step import NoDrafter
    from core.tree import build_tree
    from models.loader import heads_for, load_backbone, resolve, resolve_heads

    try:
        budgets = sorted({int(b) for b in args.budgets.split(",")})
    except ValueError:
        raise UserError(
            f"--budgets must be comma-separated node counts such as 0,4,8,16, not {args.budgets!r}."
        ) from None
    if budgets[0] < 0 or budgets[-1] > 128 or args.max_prompts < 1:
        raise UserError("--budgets must lie in 0…128 and --max-prompts be at least 1.")
    default_prompts = Path(str(resources.files("assets") / "prompts" / "calibration.jsonl"))
    prompts = _read_prompts(args.prompts or str(default_prompts))[: args.max_prompts]
    spec = resolve(args.model)
    heads_dir = resolve_heads(args.heads) if args.heads else spec.heads_folder
    if not heads_dir:
        raise UserError(f"{args.model} has no Medusa heads to calibrate; pass --heads FOLDER or train some first.")
    backbone = load_backbone(args.model, args.dtype, args.device, args.quantization, spec=spec)
    model = backbone.model
    heads, _ = heads_for(backbone, heads_dir)
    pad = backbone.tokenizer.pad_token_id if backbone.tokenizer.pad_token_id is not None else backbone.eos_ids[0]

    # 1) greedy replies and the heads' candidates at every reply position
    encoded = [backbone.encode_chat(p) for p in prompts]
    replies = []
    with tqdm(total=len(encoded), desc="greedy replies", unit="prompt") as bar:
        for b in range(0, len(encoded), 8):
            batch = encoded[b : b + 8]
            answers = train.greedy_answers(model, batch, backbone.eos_ids, pad, args.max_new_tokens)
            for ids, answer in zip(batch, answers, strict=True):
                if len(answer) > 1:
                    full = ids + answer
                    candidates = cal.head_candidates(model, heads, full, len(ids), 10)
                    replies.append(cal.reply_positions(full, len(ids), candidates))
            bar.update(len(batch))
    accuracy = cal.rank_accuracies(replies)

    # 2) this machine: step latency by tree size, and what drafting costs
    print("timing verify forwards…", file=sys.stderr)
    context = replies[0].ids
    settings = DecodeSettings()
    sizes = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80, min(budgets[-1], 128) + 1})
    trees = {n: build_tree(cal.greedy_tree(accuracy, n - 1)).to(model.device) for n in sizes}
    verify_ms = cal.verify_latency(model, context, trees, settings)
    hidden = torch.zeros(model.config.get_text_config().hidden_size, device=model.device, dtype=model.dtype)
    root = torch.tensor(context[-1], device=model.device)
    medusa = MedusaDrafter(heads, trees[max(sizes)])  # the deepest tree: every head computed
    heads_ms = cal.time_ms(lambda: medusa.propose(hidden, root, context))
    lookup = LookupDrafter(None, 3, 6)
    lookup_ms = cal.time_ms(lambda: lookup.propose(hidden, root, context))
    plain = NoDrafter(model.device)
    plain_ms = cal.time_ms(lambda: plain.propose(hidden, root)) + verify_ms[1]

    def step_ms(kind: str, nodes: float) -> float:
        extra = {"plain": 0.0, "medusa": heads_ms, "lookup": lookup_ms, "hybrid": heads_ms + lookup_ms}[kind]
        return cal.interpolate(verify_ms, nodes) + extra

    # 3) replay every option and price it
    ranked = cal.search(replies, budgets, LOOKUP_SETTINGS, step_ms)
    best = ranked[0]
    print(f"\n{'drafter':<8}{'nodes':>6}{'lookup':>8}{'tok/step':>10}{'avg T':>7}{'step ms':>9}{'tok/s':>8}")
    shown = ranked[:8] + [c for c in ranked if c.drafter == "plain"]
    for c in shown:
        look = f"{c.branches}×{c.length}" if c.branches else "—"
        print(
            f"{c.drafter:<8}{len(c.paths):>6}{look:>8}{c.tokens_per_step:>10.2f}{c.mean_nodes:>7.1f}"
            f"{c.step_ms:>9.1f}{c.tokens_per_second:>8.1f}"
        )
    out = Path(args.out).expanduser() if args.out else Path(f"{spec.name.replace('/', '--')}-calibrated.json")
    preset = {
        "paths": best.paths,
        "drafter": best.drafter if best.drafter != "plain" else "medusa",
        "lookup": {"branches": best.branches or 2, "length": best.length or 4},
        "calibration": {
            "model": args.model, "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type,
            "replies": len(replies), "positions": sum(r.match.shape[0] for r in replies),
            "top1": [round(a, 4) for a in accuracy[:, 0].tolist()],
            "top10": [round(a, 4) for a in accuracy.sum(dim=1).tolist()],
            "verify_ms": {n: round(v, 2) for n, v in verify_ms.items()},
            "heads_ms": round(heads_ms, 2), "lookup_ms": round(lookup_ms, 2), "plain_step_ms": round(plain_ms, 2),
            "expected_tokens_per_step": round(best.tokens_per_step, 3), "expected_nodes": round(best.mean_nodes, 2),
            "expected_speedup_over_plain": round(best.tokens_per_second / (1000 / plain_ms), 3),
            "best_per_drafter": {
                kind: {
                    "paths": c.paths, "lookup": {"branches": c.branches, "length": c.length},
                    "tokens_per_step": round(c.tokens_per_step, 3), "nodes": round(c.mean_nodes, 2),
                    "step_ms": round(c.step_ms, 2), "tokens_per_second": round(c.tokens_per_second, 2),
                }
                for kind in ("plain", "medusa", "lookup", "hybrid")
                if (c := next((c for c in ranked if c.drafter == kind), None))
            },
        },
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(preset, indent=1) + "\n", encoding="utf-8")
    print(f"\nwrote {out}: {best.drafter}, {len(best.paths)} head nodes; use it with --tree {out}")
    return 0


def _free_port(host: str, start: int = 7860) -> int:
    import socket

    for port in range(start, start + 100):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise UserError(f"No free port between {start} and {start + 99}; pass --port.")


def _ui(args: argparse.Namespace) -> int:
    from app.engine import Engine
    from app.ui import build, css

    port = args.port or _free_port(args.host)
    engine = Engine(args.model, args.dtype, args.device, args.quantization, args.heads)
    engine.start()
    demo = build(engine)
    demo.queue(default_concurrency_limit=1)
    print(f"medusa-chat is running at http://{args.host}:{port} (Ctrl-C to quit)", flush=True)
    try:
        demo.launch(
            server_name=args.host, server_port=port, share=False, inbrowser=not args.no_browser,
            css=css(), quiet=True, show_error=False,
        )  # fmt: skip
    except KeyboardInterrupt:
        pass
    finally:
        demo.close()
    print("medusa-chat stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
