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


def _decoding_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalog id, hub repo id or model folder")
    p.add_argument("--heads", help="Medusa heads: a folder or a hub repo id (default: the model's own)")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "nf4", "int8"],
        help="auto: 4-bit nf4 on a GPU, none on a CPU",
    )
    p.add_argument("--acceptance", default="lossless", choices=["lossless", "typical"])
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--epsilon", type=float, default=0.09, help="typical: probability threshold ε")
    p.add_argument("--delta", type=float, default=0.3, help="typical: entropy threshold δ")
    p.add_argument("--tree", help="tree preset name or JSON file (default: the model's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="medusa-chat", description=__doc__.splitlines()[0])
    sub = root.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="answer one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", help="system prompt")
    gen.add_argument("--mode", default="medusa", choices=["medusa", "baseline"])
    gen.add_argument("--num-samples", type=int, default=1, help="independent samples (seeded from --seed)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _decoding_options(gen)

    bench = sub.add_parser("bench", help="compare decoding modes on a prompt file")
    bench.add_argument("--prompts", required=True, help='JSONL file, one {"prompt": ...} per line')
    bench.add_argument("--modes", default="medusa,baseline,hf,hf-pld")
    bench.add_argument("--system", help="system prompt for every prompt")
    bench.add_argument("--json", dest="json_out", metavar="OUT", help="write the results here")
    _decoding_options(bench)
    bench.set_defaults(max_new_tokens=128)

    ui = sub.add_parser("ui", help="open the chat in the browser (the default command)")
    ui.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: this machine only)")
    ui.add_argument("--port", type=int, default=None, help="port (default: 7860 or the next free one)")
    ui.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    ui.add_argument("--model", default="smollm2-135m-instruct", help="catalog id, hub repo id or model folder")
    ui.add_argument("--heads", help="Medusa heads: a folder or a hub repo id (default: the model's own)")
    ui.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ui.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ui.add_argument("--quantization", default="auto", choices=["auto", "none", "nf4", "int8"])

    train = sub.add_parser("train-heads", help="train Medusa heads for a model by self-distillation")
    train.add_argument("--model", default="smollm2-135m-instruct", help="catalog id, hub repo id or model folder")
    train.add_argument("--prompts", required=True, help='JSONL seed prompts, one {"prompt": ...} per line')
    train.add_argument("--out", required=True, help="folder for the trained heads")
    train.add_argument("--work-dir", help="transcripts go here (default: OUT/data); a rerun resumes")
    train.add_argument("--num-heads", type=int, default=4)
    train.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    train.add_argument("--own-lm-head", action="store_true", help="a vocabulary projection per head (large)")
    train.add_argument("--epochs", type=int, default=5)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--decay", type=float, default=0.8, help="loss weight λ^k of head k")
    train.add_argument("--batch-size", type=int, default=32, help="prompts per generation batch")
    train.add_argument("--max-new-tokens", type=int, default=160)
    train.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    train.add_argument("--device", default="auto", help="auto, cpu or cuda")
    train.add_argument("--quantization", default="auto", choices=["auto", "none", "nf4", "int8"])
    train.add_argument("--seed", type=int, default=0)

    sub.add_parser("models", help="list the model catalog and what is downloaded")
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


def _setup(args: argparse.Namespace, need_drafter: bool):
    """Validate cheap things first, then load: (settings, backbone, drafter or None, tree name)."""
    from core.drafters import MedusaDrafter
    from core.tree import load_tree, preset_names
    from models.loader import heads_for, load_backbone, resolve, resolve_heads

    settings = _settings(args)
    chosen = load_tree(args.tree) if args.tree else None  # a bad tree is refused before any download
    spec = resolve(args.model)
    tree_name, tree = chosen or load_tree(spec.tree if spec.tree in preset_names() else "cpu-16")
    heads_dir = (resolve_heads(args.heads) if args.heads else spec.heads_folder) if need_drafter else None
    backbone = load_backbone(args.model, args.dtype, args.device, args.quantization, spec=spec)
    if not need_drafter:
        return settings, backbone, None, tree_name
    heads, trained = heads_for(backbone, heads_dir, num_heads=max(tree.max_depth, 4))
    if not trained:
        print(
            "warning: no trained Medusa heads for this model, so drafts are rarely accepted; pass --heads FOLDER.",
            file=sys.stderr,
        )
    drafter = MedusaDrafter(heads, tree.to(backbone.model.device), tree_name=f"Tree '{tree_name}'")
    return settings, backbone, drafter, tree_name


def _generate(args: argparse.Namespace) -> int:
    import torch

    from core.generate import Finished, stream

    if not args.prompt.strip():
        raise UserError("The prompt is empty; pass --prompt with some text.")
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be at least 1, got {args.num_samples}.")
    settings, backbone, drafter, _ = _setup(args, need_drafter=args.mode == "medusa")
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
                painter.write(e.text, e.accepted)
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
            "acceptance": args.acceptance,
            "samples": samples,
        }
        print(json.dumps(result, ensure_ascii=False))
    return 0


class _Painter:
    """Colors each step's text in a terminal: drafted-and-accepted steps stand out."""

    COLORS = ("\x1b[38;5;39m", "\x1b[38;5;208m", "\x1b[38;5;35m", "\x1b[38;5;170m")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.n = 0

    def write(self, text: str, accepted: int) -> None:
        if self.enabled and accepted:
            self.n += 1
            text = f"{self.COLORS[self.n % len(self.COLORS)]}{text}\x1b[0m"
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
    from core.bench import check_modes, run_bench, speedups, summarize, table

    modes = check_modes(args.modes.split(","))
    prompts = _read_prompts(args.prompts)
    settings, backbone, drafter, tree_name = _setup(args, need_drafter=True)
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

    runs = run_bench(encoded, modes, backbone.model, settings, drafter, backbone.eos_ids, args.seed, progress)
    summary = summarize(runs)
    print(table(summary))
    if args.json_out:
        report = {
            "model": args.model,
            "dtype": str(backbone.model.dtype).removeprefix("torch."),
            "tree": tree_name,
            "settings": asdict(settings),
            "prompts": len(prompts),
            "summary": {m: asdict(s) for m, s in summary.items()},
            "speedup": speedups(summary),
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

    # 2) hidden states, once
    print(f"computing hidden states of {len(records)} transcripts…", file=sys.stderr)
    data = train.features(model, records, args.num_heads)

    # 3) training
    lm_head = model.get_output_embeddings()
    for p in lm_head.parameters():
        p.requires_grad_(False)
    vocab, hidden = lm_head.weight.shape
    torch.manual_seed(args.seed)
    heads = MedusaHeads(hidden, vocab, args.num_heads, args.layers, None if args.own_lm_head else lm_head)
    heads = heads.to(device=model.device, dtype=torch.float32)
    data = train.Features(data.hidden.to(model.device), data.targets.to(model.device))
    result = None
    with tqdm(desc="training heads", unit="batch") as bar:
        for step, loss, accuracy in train.train(heads, data, args.epochs, args.lr, args.decay, seed=args.seed):
            if accuracy is None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")
            else:
                result = accuracy
                top1 = " ".join(f"{a:.2f}" for a in accuracy.top1)
                bar.write(f"after step {step}: held-out top-1 per head {top1}, loss {accuracy.loss:.3f}")
    heads.to(dtype=model.dtype).save(out, base_model=args.model)
    card = {
        "base_model": args.model, "prompts": len(prompts), "transcripts": len(records),
        "positions": len(data.hidden), "num_heads": args.num_heads, "layers": args.layers,
        "shared_lm_head": not args.own_lm_head, "epochs": args.epochs, "lr": args.lr, "decay": args.decay,
        "held_out_top1": list(result.top1), "held_out_top5": list(result.top5),
    }  # fmt: skip
    (out / "training.json").write_text(json.dumps(card, indent=1) + "\n", encoding="utf-8")
    print(f"heads saved in {out}; held-out top-1 per head: {', '.join(f'{a:.2f}' for a in result.top1)}")
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
