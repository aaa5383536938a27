"""Self-distillation data, the loss targets (head k learns token t + k + 2), training, CLI."""

import json
import subprocess
import sys

import pytest
import torch

from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.train import heads as train
from models.heads import MedusaHeads, load_heads
from tests.helpers import tiny_backend, tiny_model

PROMPTS = [[1, 5, 9], [1, 7, 7, 3, 2], [1, 4], [1, 8, 8, 8], [1, 3, 6, 9, 12, 15]]


def test_head_k_targets_the_token_k_plus_2_ahead():
    ids = [10, 11, 12, 13, 14, 15]
    targets = train.head_targets(ids, range(1, 4), num_heads=2)
    # position 1 holds token 11: the lm_head predicts 12, head 0 predicts 13, head 1 predicts 14
    assert targets.tolist() == [[13, 14], [14, 15], [15, -100]]


def test_features_align_hidden_states_with_their_targets():
    model = tiny_model("llama")
    record = {"prompt_ids": [1, 5, 9], "answer_ids": [20, 21, 22, 23]}
    data = train.features(model, [record], num_heads=2)
    ids = record["prompt_ids"] + record["answer_ids"]
    with torch.inference_mode():
        hidden = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    # positions 2, 3, 4: from the prompt's last token while head 0 still has a token to predict;
    # at position t head 0 learns ids[t + 2] and head 1 ids[t + 3]
    torch.testing.assert_close(data.hidden, hidden[2:5])
    assert data.targets.tolist() == [[21, 22], [22, 23], [23, -100]]


def test_distill_matches_greedy_decoding_and_resumes(tmp_path):
    backend = tiny_backend("llama")
    out = tmp_path / "transcripts.jsonl"
    eos, pad = (95,), 0
    assert train.distill(backend, PROMPTS, out, eos, pad, batch_size=2, max_new_tokens=6) == 5
    first = train.read_records(out)
    for r in first:  # left-padded batches answer exactly like one-at-a-time greedy decoding
        _, done = collect(stream(backend, r["prompt_ids"], DecodeSettings(max_new_tokens=6), eos_ids=eos))
        assert r["answer_ids"] == list(done.token_ids)
    assert sorted(r["index"] for r in first) == [0, 1, 2, 3, 4]

    lines = out.read_text().splitlines()  # an interruption: two complete lines and half of one
    out.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])
    assert train.done_records(out) == 2
    assert train.distill(backend, PROMPTS, out, eos, pad, batch_size=2, max_new_tokens=6) == 3
    again = train.read_records(out)
    assert again[:2] == first[:2] and sorted(r["index"] for r in again) == [0, 1, 2, 3, 4]
    assert {r["index"]: r["answer_ids"] for r in again} == {r["index"]: r["answer_ids"] for r in first}


def test_on_a_cpu_the_lean_forward_answers_one_at_a_time_as_batches_do(tmp_path):
    eos, pad = (95,), 0
    batched, lean = tmp_path / "batched.jsonl", tmp_path / "lean.jsonl"
    train.distill(tiny_backend("llama"), PROMPTS, batched, eos, pad, batch_size=3, max_new_tokens=8)
    backend = tiny_backend("llama+dense")  # the same weights, served by core.backends.lean
    assert backend.layer_kernel == "dense"
    train.distill(backend, PROMPTS, lean, eos, pad, batch_size=3, max_new_tokens=8)
    assert sorted(map(str, train.read_records(lean))) == sorted(map(str, train.read_records(batched)))


def test_a_rerun_with_a_higher_cap_continues_the_replies_it_cut(tmp_path):
    backend = tiny_backend("llama")
    eos, pad = (95,), 0
    whole = tmp_path / "whole.jsonl"
    train.distill(backend, PROMPTS, whole, eos, pad, batch_size=2, max_new_tokens=12)
    expected = {r["index"]: r["answer_ids"] for r in train.read_records(whole)}

    out = tmp_path / "transcripts.jsonl"
    train.distill(backend, PROMPTS, out, eos, pad, batch_size=2, max_new_tokens=4)
    short = {r["index"]: r["answer_ids"] for r in train.read_records(out)}
    cut = [i for i, a in short.items() if train.unfinished({"answer_ids": a}, eos, 12)]
    assert cut, "the tiny backend should run into the low cap"
    assert train.distill(backend, PROMPTS, out, eos, pad, batch_size=2, max_new_tokens=12) == len(cut)
    longer = {r["index"]: r["answer_ids"] for r in train.read_records(out)}
    assert longer == expected  # continuing a cut reply gives what one longer run gives
    assert train.distill(backend, PROMPTS, out, eos, pad, batch_size=2, max_new_tokens=12) == 0


def test_sampled_replies_are_reproducible_draws_and_resume(tmp_path):
    backend = tiny_backend("llama")
    eos, pad = (95,), 0
    out = tmp_path / "sampled-1.jsonl"
    assert train.distill(backend, PROMPTS, out, eos, pad, max_new_tokens=10, sample=1, indices=[0, 2, 3]) == 3
    records = train.read_records(out)
    assert sorted(r["index"] for r in records) == [0, 2, 3]
    settings = DecodeSettings(temperature=train.SAMPLED.temperature, top_p=train.SAMPLED.top_p, max_new_tokens=10)
    for r in records:  # each reply is the loop's draw from its own seeded generator
        generator = torch.Generator().manual_seed(train.SEED_STRIDE + r["index"])
        _, done = collect(stream(backend, r["prompt_ids"], settings, eos_ids=eos, generator=generator))
        assert r["answer_ids"] == list(done.token_ids)
    greedy = tmp_path / "greedy.jsonl"
    train.distill(backend, PROMPTS, greedy, eos, pad, max_new_tokens=10, indices=[0, 2, 3])
    assert {r["index"]: r["answer_ids"] for r in train.read_records(greedy)} != {
        r["index"]: r["answer_ids"] for r in records
    }
    other = tmp_path / "sampled-2.jsonl"
    train.distill(backend, PROMPTS, other, eos, pad, max_new_tokens=10, sample=2, indices=[0, 2, 3])
    assert [r["answer_ids"] for r in train.read_records(other)] != [r["answer_ids"] for r in records]
    assert train.distill(backend, PROMPTS, out, eos, pad, max_new_tokens=10, sample=1, indices=[0, 2, 3]) == 0
    assert train.distill(backend, PROMPTS, out, eos, pad, max_new_tokens=10, sample=1) == 2  # the other prompts


def test_cached_head_features_belong_to_the_transcripts_they_came_from(tmp_path):
    model = tiny_model("llama")
    records = [{"index": 0, "prompt_ids": [1, 5, 9], "answer_ids": [20, 21, 22, 23]}]
    continued = [dict(records[0], answer_ids=[20, 21, 22, 23, 24])]  # as many records, another reply
    key, other = train.transcripts_key(records), train.transcripts_key(continued)
    assert key != other
    data = train.features(model, records, num_heads=2)
    data.save(tmp_path / "features.safetensors", key)
    assert train.Features.load(tmp_path / "features.safetensors", other, 2) is None
    loaded = train.Features.load(tmp_path / "features.safetensors", key, 2)
    assert loaded is not None and loaded.targets.tolist() == data.targets.tolist()


def test_training_learns_a_learnable_target():
    torch.manual_seed(0)
    n, hidden, vocab, heads_n = 3000, 16, 12, 2
    x = torch.randn(n, hidden)
    rules = torch.randn(heads_n, hidden, vocab)
    targets = torch.stack([(x @ rules[k]).argmax(-1) for k in range(heads_n)], dim=1)
    data = train.Features(x, targets)
    heads = MedusaHeads(hidden, vocab, heads_n, 1, None)
    _, val = train.split(n, 0.1)
    before = train.evaluate(heads, data, val, 0.8)
    results = [acc for _, _, acc in train.train(heads, data, epochs=8, lr=1e-2, batch_size=128) if acc]
    after = results[-1]
    assert len(results) == 8
    assert min(after.top1) > 0.8 > max(before.top1) + 0.3
    assert after.loss < before.loss


@pytest.mark.embedded
def test_train_heads_cli_saves_loadable_heads_and_resumes(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say hi.", "Name a fruit.", "Count to 3."]))
    out = tmp_path / "heads"
    args = ["--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "24", "--epochs", "1", "--num-heads", "3"]
    run = subprocess.run([sys.executable, "-m", "app.main", "train-heads", *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    card = json.loads((out / "training.json").read_text())
    assert card["transcripts"] == 3 and len(card["held_out_top1"]) == 3
    assert "held-out top-1" in (out / "README.md").read_text() and (out / "data" / "features.safetensors").is_file()
    heads_subset = json.loads((out / "config.json").read_text())["vocab_subset"]
    assert 0 < heads_subset == card["vocab_subset"] < 49152  # read out over the tokens the model wrote
    heads = load_heads(out, torch.nn.Linear(576, 49152, bias=False))
    assert (heads.num_heads, heads.num_layers, heads.shared) == (3, 1, True)
    transcripts = (out / "data" / "transcripts.jsonl").read_text()
    rerun = subprocess.run([sys.executable, "-m", "app.main", "train-heads", *args], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert (out / "data" / "transcripts.jsonl").read_text() == transcripts  # nothing answered twice
