import json

import pytest
import torch

from core.decode.tree import build_tree, check_fits, from_parents, load_tree, preset_names
from core.errors import UserError

# Hand-checked tree: root 0; [0]→1, [1]→2, [0,0]→3, [0,1]→4, [1,0]→5
PATHS = [[1, 0], [0], [0, 1], [1], [0, 0]]  # unsorted on purpose


def test_buffers_match_hand_checked_values():
    tree = build_tree(PATHS)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert tree.size == 6 and tree.max_depth == 2 and tree.top_k == 2
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.parent.tolist() == [0, 0, 0, 1, 1, 2]
    assert tree.rank.tolist() == [-1, 0, 1, 0, 1, 0]
    assert tree.candidate_index().tolist() == [0, 1, 2, 3, 2]  # (depth - 1) * top_k + rank
    expected_visible = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert tree.visible.int().tolist() == expected_visible
    assert tree.children.tolist() == [[1, 2], [3, 4], [5, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert tree.path_to(4).tolist() == [0, 1, 4]


def test_attention_mask_sees_prefix_ancestors_and_self():
    tree = build_tree(PATHS)
    mask = tree.attention_mask(past=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 6, 9)
    hidden = torch.finfo(torch.float32).min
    assert (mask[0, 0, :, :3] == 0).all()  # the whole prefix is visible
    row = mask[0, 0, 5, 3:].tolist()  # node 5 = [1, 0]: sees root, node 2 and itself
    assert row == [0, hidden, 0, hidden, hidden, 0]


def test_root_only_tree():
    tree = build_tree([])
    assert tree.size == 1 and tree.max_depth == 0 and tree.top_k == 0
    assert tree.attention_mask(2, torch.float32).shape == (1, 1, 1, 3)


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([[0], [0, 0, 1]], "no parent path"),
        ([[0], [0]], "twice"),
        ([[0], [-1]], "ranks"),
        ([[0], []], "ranks"),
        ("[[0]]", "list of paths"),
    ],
)
def test_malformed_trees_are_refused(paths, message):
    with pytest.raises(UserError, match=message):
        build_tree(paths)


def test_tree_deeper_than_heads_or_beyond_top_k_is_refused():
    tree = build_tree([[0], [0, 0], [0, 0, 0]])
    with pytest.raises(UserError, match="3 tokens deep but the heads predict only 2"):
        check_fits(tree, num_heads=2, top_k=10)
    with pytest.raises(UserError, match="rank 4 but only the top 3"):
        check_fits(build_tree([[4]]), num_heads=4, top_k=3)
    check_fits(tree, num_heads=3, top_k=1)


def test_presets_load_and_include_the_medusa_63_node_tree():
    names = preset_names()
    assert {"chain-4", "cpu-8", "cpu-16", "cpu-32", "mc_sim_7b_63"} <= set(names)
    for name in names:
        _, tree = load_tree(name)
        assert tree.size >= 2
    _, mc = load_tree("mc_sim_7b_63")
    assert mc.size == 64 and mc.max_depth == 4 and mc.top_k == 10
    assert [load_tree(f"cpu-{n}")[1].size - 1 for n in (8, 16, 32)] == [8, 16, 32]


def test_tree_from_file_and_unknown_name(tmp_path):
    file = tmp_path / "mine.json"
    file.write_text(json.dumps({"paths": [[0], [1]]}))
    name, tree = load_tree(str(file))
    assert name == "mine" and tree.size == 3
    with pytest.raises(UserError, match="Unknown tree 'nope'; choose one of"):
        load_tree("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], ")
    with pytest.raises(UserError, match="not readable JSON"):
        load_tree(str(bad))


def test_a_nodes_path_is_made_once_and_stays_right():
    """`path_to` keeps each node's path (trees recur from step to step): the same tensor again,
    equal to the ancestors read from the mask, for every node of a tree."""
    tree = from_parents([0, 0, 0, 1, 1, 3], [-1, 0, 1, 0, 1, 0])
    for node in range(tree.size):
        want = tree.visible[node].nonzero().squeeze(1)
        first = tree.path_to(node)
        assert torch.equal(first, want) and tree.path_to(node) is first
    assert tree.path_to(5).tolist() == [0, 1, 3, 5]


def test_a_drafts_first_nodes_are_a_tree_of_their_own():
    """`Draft.first(n)`: the first n nodes of a tree (parents come first) with their tokens and
    sources, as the tree of the first n - 1 paths builds them; itself at n ≥ its size."""
    from core.drafters.base import Draft

    _, tree = load_tree("mc_sim_7b_63")
    draft = Draft(torch.arange(tree.size) + 100, tree, tuple(range(tree.size)))
    assert draft.first(tree.size) is draft and draft.first(tree.size + 5) is draft
    for n in (1, 2, 7, 30):
        cut, want = draft.first(n), build_tree(list(tree.paths[: n - 1]))
        assert cut.tree.size == n and cut.tokens.tolist() == list(range(100, 100 + n))
        assert cut.sources == tuple(range(n))
        for name in ("depth", "parent", "rank", "visible", "children"):
            assert torch.equal(getattr(cut.tree, name), getattr(want, name)), (n, name)
        assert (cut.tree.top_k, cut.tree.max_depth, cut.tree.paths) == (want.top_k, want.max_depth, want.paths)
