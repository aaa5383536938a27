"""Options shared by several commands, and the loading they lead to (model, heads, drafters).

Defining the options imports nothing heavy (torch, transformers): a command's mistakes are
refused before those load.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import UserError

if TYPE_CHECKING:
    from core.decode.settings import DecodeSettings

SEEDS = 2**64  # torch's generators take seeds from 0 to 2**64 - 1


def model_options(p: argparse.ArgumentParser, heads: bool = True) -> None:
    """Which model (and heads) to load, and how: shared by every command that loads one."""
    from models.choices import DTYPE_NAMES, QUANTIZATIONS
    from models.embedded import EMBEDDED_ID

    p.add_argument("--model", default=EMBEDDED_ID, help="catalog id, hub repo id, .gguf file or model folder")
    if heads:
        p.add_argument("--heads", help="Medusa heads: a folder or a hub repo id (default: the model's own)")
        p.add_argument(
            "--eagle",
            help="EAGLE drafter: a file from train-drafter, or an EAGLE-1/2 checkpoint's folder or hub repo id "
            "(default: the model's own)",
        )
        p.add_argument(
            "--draft-model",
            help="a smaller model of the same tokenizer that drafts for this one (catalog id, hub repo, folder), "
            "or self: this model's own weights in 4 bits drafting for it in full precision (--quantization none)",
        )
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES), help="auto: measured on this machine")
    p.add_argument("--device", default="auto", type=device_name, help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: 4-bit nf4 on a GPU; on a CPU 4-bit int4 for Llama-family models unless a --dtype is given, "
        "else none (full precision)",
    )


def decoding_options(p: argparse.ArgumentParser) -> None:
    from core.decode.settings import ACCEPTANCE_RULES
    from core.decode.tree import AUTO
    from core.drafters.registry import DRAFTERS, help_text

    model_options(p)
    p.add_argument("--acceptance", default="lossless", choices=ACCEPTANCE_RULES)
    p.add_argument("--temperature", type=finite, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=finite, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--epsilon", type=finite, default=0.09, help="typical: probability threshold ε")
    p.add_argument("--delta", type=finite, default=0.3, help="typical: entropy threshold δ")
    p.add_argument(
        "--tree", default=AUTO, help="auto (each step's tree chosen from this machine's costs), a preset or a JSON file"
    )
    p.add_argument(
        "--drafter",
        choices=DRAFTERS,
        help=help_text(),
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], type=stop_string, help="stop string (repeatable)")
    p.add_argument("--seed", type=seed, default=0)


def seed(text: str) -> int:
    """A seed torch's generators take (a whole number from 0 to 2**64 - 1)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < SEEDS:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to 2**64 - 1, got {text!r}")
    return value


def check_seeds(first: int, count: int, what: str) -> None:
    """Refuse a --seed whose `count` consecutive seeds (one per sample or prompt) run past torch's last seed."""
    if first + count > SEEDS:
        raise UserError(
            f"--seed {first} leaves too few seeds for {count} {what} (the last is 2**64 - 1); pass a smaller --seed."
        )


def writable(path: Path, option: str, folder: bool = False) -> Path:
    """`path`, once a file can be written there (with `folder`: in it, creating it), tried now
    so that a command refuses an output it could not write before its work starts, not after.
    `option` names what set the path: an option (--out) or an environment variable."""
    try:
        if path.is_dir() != folder and path.exists():
            raise OSError(f"it is {'not ' if folder else ''}a folder")
        where = path if folder else path.parent
        where.mkdir(parents=True, exist_ok=True)
        if not folder and path.exists():
            path.open("ab").close()  # appends nothing: the file is left as it is
        else:
            tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        fix = f"pass {option} a path" if option.startswith("-") else f"set {option} to a folder"
        raise UserError(f"Cannot write {path} ({e.strerror or e}); {fix} you can write to.") from None
    return path


def finite(text: str) -> float:
    """A finite number: 'inf' and 'nan' are refused like any other non-number."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string must not be empty (it would end every reply at once)")
    return text


def device_name(text: str) -> str:
    """auto, cpu, cuda or cuda:N: anything else is a usage error before any loading."""
    kind, _, index = text.partition(":")
    if (text in ("auto", "cpu", "cuda")) or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device {text!r}; choose auto, cpu, cuda or cuda:N")


def settings(args: argparse.Namespace) -> DecodeSettings:
    from core.decode.settings import DecodeSettings

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


def setup(args: argparse.Namespace, kinds: tuple[str, ...] | None, fixed: tuple[str, ...] = ()):
    """Validate cheap things first, then load: (settings, backbone, {drafter: drafter}, preset, costs).

    `kinds` None means the drafter chosen by --drafter or, failing that, by the model's preset.
    With --tree auto each kind gets the speculation policy; `fixed` adds "KIND@PRESET" drafters
    on a fixed tree (bench compares them). Only what these drafters need is loaded (`registry.needs`)."""
    from app.drafting import load_parts
    from core.decode.tree import AUTO, load_preset, preset_names
    from core.drafters.build import auto_drafter, make_drafter
    from core.drafters.draft_model import MISSING
    from core.drafters.registry import default_kind, needs
    from models.loader import load_backbone, resolve, resolve_eagle, resolve_heads, step_costs

    decode = settings(args)
    auto = args.tree in (None, AUTO)
    chosen = None if auto else load_preset(args.tree)  # a bad tree is refused before any download
    fixed_presets = {f: load_preset(f.partition("@")[2]) for f in fixed}
    spec = resolve(args.model)
    preset = chosen or load_preset(spec.tree if spec.tree in preset_names() else "cpu-16")
    draft_model = getattr(args, "draft_model", None)
    kinds = kinds if kinds is not None else (args.drafter or default_kind(preset.drafter, bool(draft_model)),)
    own = needs(kinds, auto)  # the chosen kinds' needs, then with the fixed-tree ones'
    need = own | needs((f.partition("@")[0] for f in fixed), auto=False)
    heads_dir = (resolve_heads(args.heads) if args.heads else spec.heads_folder) if need.heads else None
    given = getattr(args, "eagle", None)
    eagle_path = (resolve_eagle(given) if given else spec.eagle) if need.eagle_if_any else None
    if need.draft and not draft_model:  # refused before anything loads
        raise UserError(MISSING)
    backbone = load_backbone(args.model, args.dtype, args.device, args.quantization, spec=spec)
    depth = max([preset.tree.max_depth, *(p.tree.max_depth for p in fixed_presets.values()), 4])
    parts = load_parts(backbone, need, heads_dir, eagle_path, num_heads=depth, draft_model=draft_model)
    if need.heads and not parts.trained:
        print(
            "note: no trained Medusa heads for this model: the speculation policy drafts with the lookups "
            "(pass --heads FOLDER or --draft-model MODEL to draft more)."
            if auto
            else "warning: no trained Medusa heads for this model, so drafts are rarely accepted; pass --heads FOLDER.",
            file=sys.stderr,
        )
    device = backbone.model.device

    def fixed_drafter(kind: str, p):
        tree = p.tree.to(device)
        name = f"Tree '{p.name}'"
        return make_drafter(
            kind, parts.heads, tree, name, p.lookup_branches, p.lookup_length, parts.corpus, parts.eagle, parts.draft
        )

    costs = None  # the machine's step-cost curve (the caller measures it when `needed`, at an idle moment)
    if auto and kinds:
        costs = step_costs(backbone, parts.heads if own.heads else None)
        made = (parts.heads, costs.curve, preset, parts.trained, parts.corpus, parts.eagle, parts.draft)
        drafters = {k: auto_drafter(k, *made, costs.rates(k)) for k in kinds}
    else:
        drafters = {k: fixed_drafter(k, preset) for k in kinds}
    drafters |= {f: fixed_drafter(f.partition("@")[0], p) for f, p in fixed_presets.items()}
    return decode, backbone, drafters, preset, costs


def answer_prompts(
    backbone, prompts: list[str], transcripts: Path, batch_size: int, max_new_tokens: int, sample: int = 0,
    indices: list[int] | None = None,
) -> int:  # fmt: skip
    """The model's greedy replies to `prompts` (`sample` k > 0: its k-th sampled ones, to the
    prompts at `indices`), appended to `transcripts` batch by batch with a progress bar (a rerun
    resumes, and continues replies an earlier run cut shorter); returns how many this run answered."""
    from tqdm.auto import tqdm

    from core.train import heads as train

    encoded = [backbone.encode_chat(p) for p in prompts]
    desc = f"sampling replies ({sample})" if sample else "answering prompts"
    with tqdm(total=len(prompts) if indices is None else len(indices), desc=desc, unit="prompt") as bar:
        return train.distill(
            backbone.backend, encoded, transcripts, backbone.eos_ids, backbone.pad_id, batch_size, max_new_tokens,
            lambda done, total: bar.update(done - bar.n), sample, indices,
        )  # fmt: skip


def read_prompts(file: str) -> list[str]:
    return [prompt for prompt, _ in read_labelled(file)]


def read_labelled(file: str) -> list[tuple[str, str]]:
    """(prompt, category) per non-empty line of a JSONL file; the category is "" where none is given."""
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
            record = json.loads(line)
            prompt, category = record["prompt"], record.get("category", "")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UserError(f'Line {n} of {path} is not a JSON object with a "prompt"; fix that line.') from None
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f'Line {n} of {path} has an empty "prompt"; fill it or remove the line.')
        prompts.append((prompt, category if isinstance(category, str) else str(category)))
    if not prompts:
        raise UserError(f'{path} holds no prompts; add lines like {{"prompt": "Hello"}}.')
    return prompts
