"""Downloads, for real, against a local server speaking the hub's file API."""

import itertools
import json
import os
import subprocess
import sys

import pytest
from huggingface_hub import constants

from core.errors import UserError
from models import hub
from tests.fake_hub import FakeHub

REPO = "tiny-org/tiny-model"
BIG = 24 * 2**20  # above huggingface_hub's 10 MB chunk, so a cut leaves bytes to resume from


@pytest.fixture
def files():
    return {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": os.urandom(BIG),
        "pytorch_model.bin": b"old copy of the weights",
        "README.md": b"# tiny",
    }


def fetch(fake, tmp_path, **kw):
    kw.setdefault("patterns", ["*.json", "*.safetensors", "*.bin"])
    return hub.fetch(REPO, cache_dir=tmp_path / "hub", endpoint=fake.url, **kw)


def test_files_land_in_the_hub_cache_and_a_second_call_downloads_nothing(tmp_path, files):
    with FakeHub({REPO: files}) as fake:
        progress = []
        folder = fetch(fake, tmp_path, weights=True, on_progress=progress.append)
        assert folder.is_relative_to(tmp_path / "hub" / "models--tiny-org--tiny-model" / "snapshots")
        assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
        assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]
        assert not any("pytorch_model.bin" in p for p in fake.file_gets())  # safetensors preferred
        assert not any("README" in p for p in fake.file_gets())  # only the files asked for
        assert progress[-1].done == progress[-1].total == BIG + len(files["config.json"])
        assert all(a.done <= b.done for a, b in itertools.pairwise(progress))

        before = len(fake.file_gets())
        assert fetch(fake, tmp_path, weights=True) == folder
        assert len(fake.file_gets()) == before


def test_a_connection_cut_mid_file_resumes(tmp_path, files):
    with FakeHub({REPO: files}) as fake:
        fake.cut_once.add((REPO, "model.safetensors"))
        folder = fetch(fake, tmp_path, patterns=["*.safetensors"])
        assert (folder / "model.safetensors").read_bytes() == files["model.safetensors"]
        ranges = [r for m, p, r in fake.requests if m == "GET" and p.endswith("model.safetensors")]
        assert ranges[0] is None and ranges[1].startswith("bytes=") and int(ranges[1][6:-1]) > 0


def test_a_full_disk_is_refused_before_anything_is_written(tmp_path, files, monkeypatch):
    monkeypatch.setattr(hub, "free_bytes", lambda path: 10 * 2**20)
    with FakeHub({REPO: files}) as fake:
        with pytest.raises(UserError, match=r"tiny-org/tiny-model needs 24.0 MB more but only 10.0 MB is free"):
            fetch(fake, tmp_path, weights=True)
        assert fake.file_gets() == []


def test_offline_uses_the_cache_or_says_how_to_fetch_later(tmp_path, files, monkeypatch):
    with FakeHub({REPO: files}) as fake:
        folder = fetch(fake, tmp_path, patterns=["config.json"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.fetch(REPO, patterns=["config.json"], cache_dir=tmp_path / "hub") == folder
    with pytest.raises(UserError, match=r"other/model is not downloaded .* `medusa-chat download other/model`"):
        hub.fetch("other/model", cache_dir=tmp_path / "hub")


def test_an_unreachable_hub_counts_as_offline(tmp_path):
    with pytest.raises(UserError, match="is not downloaded and the hub cannot be reached"):
        hub.fetch(REPO, cache_dir=tmp_path / "hub", endpoint="http://127.0.0.1:9")


def test_a_missing_repo_gets_one_sentence(tmp_path, files):
    with FakeHub({REPO: files}) as fake, pytest.raises(UserError, match="The hub refused no/such"):
        hub.fetch("no/such", cache_dir=tmp_path / "hub", endpoint=fake.url)


def test_the_cli_downloads_into_hf_hub_cache(tmp_path, files):
    with FakeHub({REPO: files}) as fake:
        env = {**os.environ, "HF_ENDPOINT": fake.url, "HF_HUB_CACHE": str(tmp_path / "cache")}
        run = subprocess.run(
            [sys.executable, "-m", "app.main", "download", REPO],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    assert run.returncode == 0, run.stderr
    snapshot = next((tmp_path / "cache" / "models--tiny-org--tiny-model" / "snapshots").iterdir())
    assert (snapshot / "model.safetensors").stat().st_size == BIG
    assert json.loads((snapshot / "config.json").read_text()) == {"model_type": "llama"}
    assert "is ready in" in run.stdout
