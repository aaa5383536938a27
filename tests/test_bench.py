"""Bench summaries: fidelity against the plain loop."""

from __future__ import annotations

from app.bench import Run, fidelity, first_difference, summarize, table


def test_first_difference():
    assert first_difference((1, 2, 3), (1, 2, 3)) is None
    assert first_difference((1, 2, 3), (1, 5, 3)) == 1
    assert first_difference((1, 2), (1, 2, 3)) == 2  # stopped early: differs where it stopped
    assert first_difference((), (4,)) == 0


def test_fidelity_counts_exact_replies_and_averages_the_rest():
    pairs = [((1, 2, 3), (1, 2, 3)), ((1, 9), (1, 2)), ((7,), (1,)), ((4, 4, 4, 5), (4, 4, 4, 4))]
    assert fidelity(pairs) == (1, (1 + 0 + 3) / 3)
    assert fidelity([((1,), (1,))]) == (1, None)


def test_summary_compares_every_mode_with_the_plain_loop():
    runs = [
        Run("baseline", 0, 3, 3, 1.0, token_ids=(1, 2, 3)),
        Run("medusa", 0, 3, 2, 0.5, token_ids=(1, 2, 3)),
        Run("baseline", 1, 2, 2, 1.0, token_ids=(5, 6)),
        Run("medusa", 1, 2, 1, 0.5, token_ids=(5, 7)),
    ]
    summary = summarize(runs)
    assert (summary["baseline"].exact, summary["baseline"].first_difference) == (2, None)
    assert (summary["medusa"].exact, summary["medusa"].first_difference) == (1, 1.0)
    rows = table(summary, 2).splitlines()
    assert rows[0].split()[-3:] == ["plain", "1st", "diff"] and rows[2].split()[-2:] == ["1/2", "1.0"]
    alone = summarize([r for r in runs if r.mode == "medusa"])  # no plain loop to compare with
    assert alone["medusa"].exact is None and table(alone, 2).splitlines()[1].split()[-2:] == ["—", "—"]


def test_a_peer_engine_runs_through_the_bench_with_one_token_per_step():
    from app.bench import run_bench
    from core.decode.settings import DecodeSettings
    from tests.helpers import tiny_backend

    asked = []

    def peer(prompt_ids, settings, eos_ids):
        asked.append((tuple(prompt_ids), settings.max_new_tokens))
        return (5, 6, 7), 0.25

    prompts = [[1, 2, 3], [4, 5]]
    runs = run_bench(prompts, ("baseline", "llamacpp"), tiny_backend(), DecodeSettings(max_new_tokens=3), {}, (), 0,
                     peers={"llamacpp": peer})  # fmt: skip
    mine = [r for r in runs if r.mode == "llamacpp"]
    assert [(r.tokens, r.steps, r.seconds, r.token_ids) for r in mine] == [(3, 3, 0.25, (5, 6, 7))] * 2
    assert asked == [((1, 2, 3), 8), ((1, 2, 3), 3), ((4, 5), 3)]  # a warm-up, then each prompt


def test_rows_by_context_length_time_the_first_token_and_the_decode_after_it():
    from app.bench import by_context, context_table

    runs = {
        100: [Run("baseline", 0, 11, 11, 1.1, first_token_seconds=0.1, prompt_tokens=100)],
        4000: [Run("baseline", 1, 11, 11, 3.0, first_token_seconds=1.0, prompt_tokens=4000),
               Run("llamacpp", 1, 10, 10, 2.0, prompt_tokens=4000)],  # a peer that does not time its first token
    }  # fmt: skip
    short, long, peer = by_context(runs)
    assert (short.context, short.first_token_ms, short.read_per_second, short.decode_per_second) == (100, 100, 1000, 10)
    assert (long.context, long.read_per_second, long.decode_per_second) == (4000, 4000, 5)
    assert (peer.first_token_ms, peer.read_per_second, peer.decode_per_second) == (0, 0, 5)
    lines = context_table([short, long, peer]).splitlines()
    assert lines[2].split()[-1] == "0.50×" and lines[3].split()[2:4] == ["—", "—"]


def test_the_bench_times_each_replys_first_token_in_every_kind_of_mode():
    from app.bench import run_bench
    from core.decode.settings import DecodeSettings
    from tests.helpers import tiny_backend

    def peer(prompt_ids, settings, eos_ids):
        return (5, 6, 7), 0.25, 0.05

    runs = run_bench([[1, 2, 3, 4]], ("baseline", "hf", "llamacpp"), tiny_backend(), DecodeSettings(max_new_tokens=3),
                     {}, (), 0, peers={"llamacpp": peer})  # fmt: skip
    assert all(r.prompt_tokens == 4 and 0 < r.first_token_seconds < r.seconds for r in runs)
    assert [r.first_token_seconds for r in runs if r.mode == "llamacpp"] == [0.05]


def test_context_lengths_are_checked_before_anything_loads():
    import pytest

    from app.cli.bench import _lengths
    from core.errors import UserError

    assert _lengths("100,1000,4000") == [100, 1000, 4000] and _lengths(None) == []
    for wrong in ("", "100,,", "0", "1k"):
        with pytest.raises(UserError, match="--context takes prompt lengths"):
            _lengths(wrong)


def test_a_prompt_is_lengthened_to_the_context_asked_for(tmp_path):
    from tokenizers import decoders
    from transformers import AutoTokenizer

    from app.cli.bench import _lengthened, _notes
    from models.loader import Backbone
    from tests.tiny_folder import save_tiny_model

    save_tiny_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # decoded characters joined as they are
    backbone = Backbone("tiny", None, tokenizer, (0,))
    prompt = backbone.encode_chat("Name three rivers.")
    notes = _notes(backbone)
    assert len(notes) > 10_000  # enough for the longest contexts
    for length in (300, 2000):
        ids = _lengthened(backbone, "Name three rivers.", length, None, notes)
        assert abs(len(ids) - length) <= 3 and ids[-len(prompt) :] == prompt
    assert _lengthened(backbone, "Name three rivers.", 5, None, notes) == prompt  # longer already


def test_acceptance_by_depth_counts_where_the_accepted_path_reached():
    from types import SimpleNamespace

    from app.bench import Run, acceptance, depth_counts

    chain = SimpleNamespace(parents=(0, 0, 1, 2), path=(0, 1))  # a chain of 3: depth 1 accepted, depth 2 not
    branches = SimpleNamespace(parents=(0, 0, 0, 1), path=(0, 2))  # node 2 (depth 1) accepted, it has no child
    plain = SimpleNamespace(parents=(0,), path=(0,))
    whole = SimpleNamespace(parents=(0, 0, 1), path=(0, 1, 2))  # both depths accepted, nothing deeper offered
    counts = depth_counts([chain, branches, plain, whole])
    assert counts == ((3, 3), (2, 1))
    runs = [Run("draft", 0, 1, 1, 1.0, depths=counts), Run("draft", 1, 1, 1, 1.0, depths=((1, 0),))]
    assert acceptance(runs) == (3 / 4, 1 / 2)
