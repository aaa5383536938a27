"""Bench summaries: fidelity against the plain loop."""

from __future__ import annotations

from core.bench import Run, fidelity, first_difference, summarize, table


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
    from core.bench import run_bench
    from core.settings import DecodeSettings
    from tests.helpers import tiny_model

    asked = []

    def peer(prompt_ids, settings, eos_ids):
        asked.append((tuple(prompt_ids), settings.max_new_tokens))
        return (5, 6, 7), 0.25

    prompts = [[1, 2, 3], [4, 5]]
    runs = run_bench(prompts, ("baseline", "llamacpp"), tiny_model(), DecodeSettings(max_new_tokens=3), {}, (), 0,
                     peers={"llamacpp": peer})  # fmt: skip
    mine = [r for r in runs if r.mode == "llamacpp"]
    assert [(r.tokens, r.steps, r.seconds, r.token_ids) for r in mine] == [(3, 3, 0.25, (5, 6, 7))] * 2
    assert asked == [((1, 2, 3), 8), ((1, 2, 3), 3), ((4, 5), 3)]  # a warm-up, then each prompt
