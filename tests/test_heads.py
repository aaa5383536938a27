import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.errors import UserError
from models.heads import CONFIG, WEIGHTS, MedusaHeads, load_heads

H, V = 32, 50


def lm_head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(H, V, bias=False)


def randomized(heads: MedusaHeads) -> MedusaHeads:
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("layers", [1, 2])
def test_save_load_round_trip_gives_the_same_logits(tmp_path, shared, layers):
    head = lm_head()
    heads = randomized(MedusaHeads(H, V, num_heads=3, num_layers=layers, shared_lm_head=head if shared else None))
    heads.save(tmp_path)
    loaded = load_heads(tmp_path, head)
    assert (loaded.num_heads, loaded.num_layers, loaded.shared) == (3, layers, shared)
    h = torch.randn(5, H)
    torch.testing.assert_close(loaded(h), heads(h), rtol=0, atol=0)
    assert loaded(h).shape == (5, 3, V) and loaded(h[0], count=2).shape == (2, V)


def test_layout_is_the_medusa_one_and_the_shared_head_is_not_saved(tmp_path):
    MedusaHeads(H, V, 2, 1, lm_head()).save(tmp_path)
    keys = set(load_file(tmp_path / WEIGHTS))
    assert keys == {"0.0.linear.weight", "0.0.linear.bias", "1.0.linear.weight", "1.0.linear.bias"}
    MedusaHeads(H, V, 1, 1, None).save(tmp_path / "own")
    assert "0.1.weight" in load_file(tmp_path / "own" / WEIGHTS)


def test_head_and_layer_counts_come_from_the_tensors(tmp_path):
    randomized(MedusaHeads(H, V, num_heads=5, num_layers=1, shared_lm_head=None)).save(tmp_path)
    config = json.loads((tmp_path / CONFIG).read_text())
    config["medusa_num_heads"], config["medusa_num_layers"] = 2, 3
    (tmp_path / CONFIG).write_text(json.dumps(config))
    loaded = load_heads(tmp_path, lm_head())
    assert (loaded.num_heads, loaded.num_layers) == (5, 1)


def test_head_k_uses_its_own_block():
    heads = randomized(MedusaHeads(H, V, 3, 1, lm_head()))
    h = torch.randn(H)
    for k in range(3):
        torch.testing.assert_close(heads(h)[k], heads._shared[0](heads.heads[k](h)))


def test_heads_for_another_model_are_refused(tmp_path):
    MedusaHeads(H, V, 2, 1, lm_head()).save(tmp_path / "hidden")
    other_hidden = torch.nn.Linear(H * 2, V, bias=False)
    with pytest.raises(UserError, match="hidden size 32 and vocabulary 50, but tiny has 64 and 50"):
        load_heads(tmp_path / "hidden", other_hidden, "tiny")
    MedusaHeads(H, V, 2, 1, None).save(tmp_path / "vocab")
    with pytest.raises(UserError, match=r"vocabulary 50, but .* 32 and 60"):
        load_heads(tmp_path / "vocab", torch.nn.Linear(H, 60, bias=False))
    MedusaHeads(H, V, 2, 1, lm_head()).save(tmp_path / "shared")
    with pytest.raises(UserError, match="vocabulary 50"):
        load_heads(tmp_path / "shared", torch.nn.Linear(H, 60, bias=False))


def test_missing_damaged_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(UserError, match="No Medusa heads"):
        load_heads(tmp_path, lm_head())
    (tmp_path / WEIGHTS).write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="damaged"):
        load_heads(tmp_path, lm_head())
    save_file({"embed.weight": torch.zeros(2, 2)}, tmp_path / WEIGHTS)
    with pytest.raises(UserError, match="no Medusa head tensors"):
        load_heads(tmp_path, lm_head())


def test_a_vocabulary_subset_round_trips_and_proposes_only_its_tokens(tmp_path):
    head = lm_head()
    subset = torch.tensor([3, 7, 8, 20, 41, 49])
    heads = randomized(MedusaHeads(H, V, num_heads=2, shared_lm_head=head, token_ids=subset))
    h = torch.randn(4, H)
    full = heads.heads[0](h) @ head.weight.t()  # the same head read out over every token
    torch.testing.assert_close(heads(h)[:, 0], full[:, subset])
    heads.save(tmp_path)
    loaded = load_heads(tmp_path, head)
    assert torch.equal(loaded.token_ids, subset) and json.loads((tmp_path / CONFIG).read_text())["vocab_subset"] == 6
    cands = loaded.candidates(h[0], 2, 3)
    assert cands.shape == (2, 3) and set(cands.flatten().tolist()) <= set(subset.tolist())
    best = subset[(heads.heads[1](h[0]) @ head.weight.t())[subset].argmax()]
    assert cands[1, 0] == best
    targets = torch.tensor([[7, -100], [49, 5]])
    assert heads.target_index(targets).tolist() == [[1, -100], [5, -100]]  # 5 is outside the subset


@pytest.mark.parametrize("layout", ["shared", "subset", "own"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("kernel", ["dense", "onednn"])
def test_packed_heads_draft_what_the_modules_do(layout, layers, kernel):
    hidden, vocab = 64, 200
    head = torch.nn.Linear(hidden, vocab, bias=False)
    subset = torch.tensor([3, 7, 9, 150, 199]) if layout == "subset" else None
    heads = randomized(MedusaHeads(hidden, vocab, 3, layers, None if layout == "own" else head, subset)).eval()
    h = torch.randn(4, hidden)
    want = heads(h)
    heads.pack(kernel, torch.float32)
    assert heads.drafting == f"{kernel} float32"
    got = heads(h)
    assert got.shape == want.shape and heads(h[0], count=2).shape == want[0, :2].shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(heads(h[0], count=2), want[0, :2], rtol=1e-4, atol=1e-4)
    heads.train()  # training reads the modules again: the packed copies would go stale
    assert heads.drafting == "module"


def test_int4_packed_heads_keep_their_top_candidates():
    hidden, vocab = 64, 300  # 300 rows: padded to the int4 layout's multiple of 64
    heads = randomized(MedusaHeads(hidden, vocab, 2, 1, None)).eval()
    h = torch.randn(8, hidden)
    want = heads(h)
    heads.pack("int4", torch.bfloat16)
    got = heads(h).float()
    assert got.shape == want.shape
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.99
