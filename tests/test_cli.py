"""The command line on the embedded SmolLM2 model (converted once per machine, ~25 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from models.heads import MedusaHeads

pytestmark = pytest.mark.embedded

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "List three uses of a paperclip.",
]


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.main", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def random_heads_dir(tmp_path_factory) -> str:
    """Randomly initialised shared-lm_head heads for SmolLM2 (576 hidden, 49152 vocabulary)."""
    folder = tmp_path_factory.mktemp("heads")
    torch.manual_seed(0)
    heads = MedusaHeads(576, 49152, num_heads=4, num_layers=1, shared_lm_head=torch.nn.Linear(576, 1))
    for block in heads.heads:
        torch.nn.init.normal_(block[0].linear.weight, std=0.05)
    heads.save(folder)
    return str(folder)


def generate_json(*args: str) -> dict:
    result = cli("generate", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("tree", ["cpu-16", "mc_sim_7b_63"])
def test_medusa_equals_baseline_in_float32_at_temperature_zero(random_heads_dir, tree):
    for prompt in PROMPTS:
        common = ["--prompt", prompt, "--dtype", "float32", "--max-new-tokens", "48", "--temperature", "0"]
        medusa = generate_json(*common, "--mode", "medusa", "--heads", random_heads_dir, "--tree", tree)
        baseline = generate_json(*common, "--mode", "baseline")
        (m,), (b,) = medusa["samples"], baseline["samples"]
        assert m["token_ids"] == b["token_ids"] and m["text"] == b["text"]
        assert len(m["token_ids"]) == sum(m["steps"]) and len(b["token_ids"]) == sum(b["steps"])
        assert set(b["steps"]) == {1}
        assert (medusa["mode"], baseline["mode"], medusa["acceptance"]) == ("medusa", "baseline", "lossless")


@pytest.mark.parametrize("drafter", ["lookup", "hybrid"])
def test_lookup_drafters_equal_baseline_in_float32(random_heads_dir, drafter):
    prompt = "Repeat after me: the quick brown fox jumps over the lazy dog, the quick brown fox."
    common = ["--prompt", prompt, "--dtype", "float32", "--max-new-tokens", "40"]
    ours = generate_json(*common, "--drafter", drafter, "--heads", random_heads_dir)
    baseline = generate_json(*common, "--mode", "baseline")
    assert ours["samples"][0]["token_ids"] == baseline["samples"][0]["token_ids"]
    assert ours["drafter"] == drafter and max(ours["samples"][0]["steps"]) > 1  # the copy was accepted


def test_calibrate_writes_a_preset_that_decodes(tmp_path, random_heads_dir):
    prompts = tmp_path / "cal.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]))
    out = tmp_path / "preset.json"
    args = ["--heads", random_heads_dir, "--prompts", str(prompts), "--max-new-tokens", "24"]
    result = cli("calibrate", *args, "--budgets", "0,2,4", "--out", str(out))
    assert result.returncode == 0, result.stderr
    preset = json.loads(out.read_text())
    assert preset["drafter"] in ("medusa", "lookup", "hybrid") and len(preset["paths"]) <= 4
    # timed by the sizes the heads' accuracies can build: random heads may be right at few ranks
    assert preset["calibration"]["replies"] == 2 and {"1"} < set(preset["calibration"]["verify_ms"])
    assert "tok/step" in result.stdout
    ours = generate_json(
        "--prompt", PROMPTS[0], "--tree", str(out), "--heads", random_heads_dir, "--max-new-tokens", "8"
    )
    assert ours["tree"] == "preset" and len(ours["samples"][0]["token_ids"]) == 8


def test_num_samples_are_independent_and_seeded():
    # float32: the policy's trees (which follow timings) then cannot change a token by rounding
    args = ["--prompt", "Tell me a story.", "--temperature", "1.0", "--max-new-tokens", "12", "--dtype", "float32"]
    first = generate_json(*args, "--num-samples", "3", "--seed", "5")["samples"]
    again = generate_json(*args, "--num-samples", "3", "--seed", "5")["samples"]
    assert len(first) == 3 and [s["token_ids"] for s in first] == [s["token_ids"] for s in again]
    assert len({tuple(s["token_ids"]) for s in first}) > 1


def test_streamed_text_and_summary(random_heads_dir):
    result = cli("generate", "--prompt", "Say hello.", "--max-new-tokens", "16", "--heads", random_heads_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tokens/step" in result.stderr and "finished by" in result.stderr


def test_bench_prints_every_mode(tmp_path, random_heads_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(PROMPTS[:2])))
    out = tmp_path / "bench.json"
    result = cli(
        "bench",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--heads",
        random_heads_dir,
        "--modes",
        ",".join(MODES),
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    table = result.stdout
    for mode in MODES:
        assert any(line.startswith(mode + " ") for line in table.splitlines()), table
    report = json.loads(out.read_text())
    for mode in MODES:
        s = report["summary"][mode]
        assert s["tokens"] > 0 and s["steps"] > 0 and s["seconds"] > 0
        assert s["tokens_per_second"] == pytest.approx(s["tokens"] / s["seconds"])
        assert s["tokens_per_step"] == pytest.approx(s["tokens"] / s["steps"])
    assert report["summary"]["baseline"]["tokens_per_step"] == 1.0
    assert report["summary"]["baseline"]["exact"] == 2 and report["summary"]["baseline"]["first_difference"] is None
    assert all(0 <= report["summary"][m]["exact"] <= 2 for m in MODES)
    assert set(report["speedup"]) == {"lookup", "hybrid", "baseline", "hf", "hf-pld"}
    assert set(report["speedups"]) == {"medusa", "lookup", "hybrid"}
    assert len(report["runs"]) == 2 * len(MODES)


MODES = ("medusa", "lookup", "hybrid", "baseline", "hf", "hf-pld")


def test_bad_input_gives_one_sentence_and_a_nonzero_exit(tmp_path, random_heads_dir):
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]))
    other = tmp_path / "other-heads"
    MedusaHeads(64, 49152, 2, 1, None).save(other)
    bad_prompts = tmp_path / "bad.jsonl"
    bad_prompts.write_text('{"prompt": "ok"}\nnot json\n')
    cases = {
        "empty prompt": (["generate", "--prompt", "  "], "prompt is empty"),
        "unknown tree": (["generate", "--prompt", "hi", "--tree", "bushy"], "Unknown tree 'bushy'"),
        "tree too deep": (
            ["generate", "--prompt", "hi", "--tree", str(deep), "--heads", random_heads_dir],
            "5 tokens deep but the heads predict only 4",
        ),
        "epsilon zero": (["generate", "--prompt", "hi", "--acceptance", "typical", "--epsilon", "0"], "ε"),
        "foreign heads": (["generate", "--prompt", "hi", "--heads", str(other)], "hidden size 64"),
        "unknown model": (["generate", "--prompt", "hi", "--model", str(tmp_path / "none")], "Unknown model"),
        "missing heads folder": (["generate", "--prompt", "hi", "--heads", "/no-such-heads"], "No heads folder"),
        "bad prompt file": (["bench", "--prompts", str(bad_prompts)], "Line 2"),
        "unknown mode": (["bench", "--prompts", str(bad_prompts), "--modes", "fast"], "Unknown bench mode"),
    }
    empty_tree = tmp_path / "empty.json"
    empty_tree.write_text("[]")
    cases |= {
        "infinite temperature": (["generate", "--prompt", "hi", "--temperature", "inf"], "'inf'"),
        "nan top-p": (["generate", "--prompt", "hi", "--top-p", "nan"], "'nan'"),
        "empty stop string": (["generate", "--prompt", "hi", "--stop", ""], "stop string must not be empty"),
        "empty tree": (["generate", "--prompt", "hi", "--tree", str(empty_tree)], "has no paths"),
        "unknown device": (["generate", "--prompt", "hi", "--device", "bogus"], "unknown device 'bogus'"),
        "unknown ui option": (["--port", "80", "--colour"], "unrecognized arguments: --colour"),
        "seed beyond torch's": (["generate", "--prompt", "hi", "--seed", str(10**30)], "expected a seed"),
        "port out of range": (["--port", "99999"], "expected a port from 1 to 65535"),
    }
    for name, (args, expected) in cases.items():
        result = cli(*args)
        assert result.returncode == 2, (name, result.stderr)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and expected in errors[0], (name, result.stderr)
        assert "Traceback" not in result.stderr, name


def test_bench_llamacpp_runs_or_says_in_one_sentence_why_not(tmp_path):
    import importlib.util

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}))
    result = cli("bench", "--prompts", str(prompts), "--max-new-tokens", "8", "--modes", "baseline,llamacpp")
    assert result.returncode == 0, result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines()[1:]]
    if importlib.util.find_spec("llama_cpp") is None:
        assert rows == ["baseline"] and "llama.cpp is not installed" in result.stderr
    else:
        assert rows == ["baseline", "llamacpp"]


def test_the_program_freezes_its_objects_for_the_exit(monkeypatch):
    """`medusa-chat` (app.main:entry) returns main's status with the process's objects frozen, so
    the interpreter's last collection does not walk them."""
    import gc

    import app.main

    monkeypatch.setattr(app.main, "main", lambda argv: 3)
    gc.unfreeze()
    try:
        assert app.main.entry() == 3
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
