"""The step-cost profile: its parts, its sizes, the machine it names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from core.measure import profile
from tests.helpers import tiny_backend


def test_step_costs_cover_every_size_and_part():
    costs = profile.step_costs(tiny_backend("llama"), list(range(1, 40)), None, sizes=(1, 2, 8, 64), repeats=1)
    assert [c.nodes for c in costs] == [1, 2, 8, 64]
    for c in costs:
        assert c.total_ms > 0 and c.layers_ms > 0 and c.lm_head_ms > 0 and c.accept_ms > 0
        assert c.draft_ms == 0 and c.commit_ms >= 0
    assert costs[0].mask_ms == 0  # a one-node step needs no mask
    lines = profile.table(costs).splitlines()
    assert len(lines) == 5 and lines[1].split()[:3] == ["1", f"{costs[0].total_ms:.2f}", "1.00"]


def test_shaped_trees_are_valid_prefixes():
    for n in profile.SIZES:
        tree = profile.shaped_tree(n)
        assert tree.size == n and tree.max_depth <= 4
    with pytest.raises(ValueError):
        profile.shaped_tree(65)


def test_the_machine_names_the_kernels_in_use():
    here = profile.machine(torch.device("cpu"))
    assert here.kernels == torch.backends.cpu.get_cpu_capability()
    assert here.threads == torch.get_num_threads() and here.torch == torch.__version__
    assert here.kernels in here.key and here.torch in here.key


@pytest.mark.embedded
def test_profile_json_on_the_embedded_model():
    args = ["profile", "--json", "--sizes", "1,8", "--repeats", "1", "--dtype", "float32", "--context", "2500"]
    result = subprocess.run([sys.executable, "-m", "app.main", *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [s["nodes"] for s in report["steps"]] == [1, 8] and report["dtype"] == "float32"
    assert report["context"] == 2500  # as long as asked (it stopped at ~1,100 tokens of its text)
    assert report["steps"][1]["draft_ms"] > 0  # the shipped heads drafted
    assert set(report["machine"]) >= {"cpu", "isa", "kernels", "threads", "torch"}
    assert "nodes…" in result.stderr
