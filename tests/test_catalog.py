"""The model catalog: every entry checks out (ids, sources, drafters, memory from the parameter
count), the checks catch each kind of mistake, `medusa-chat models` lists the CPU entries first,
and `--model ID` for a CPU entry fetches its one GGUF file (through a local server speaking the
hub's file API) and opens it as that file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from core.decode.tree import preset_names
from models import catalog
from models.catalog import Source, memory_4bit_gb, problems

CPU = [e for e in catalog.entries() if e.target == "cpu"]
GPU = [e for e in catalog.entries() if e.target == "gpu"]
FAMILIES_NEEDED = {"qwen3", "qwen2.5", "llama3", "smollm2", "gemma3"}  # issue 32's small chat families


def test_every_entry_checks_out():
    assert problems(catalog.entries()) == []
    ids = [e.id for e in catalog.entries()]
    assert len(ids) == len(set(ids))
    presets = set(preset_names())
    templates = {p.stem for p in (Path(catalog.__file__).parents[1] / "assets" / "templates").glob("*.jinja")}
    for e in catalog.entries():
        assert e.tree in presets, e.id
        assert e.chat_template is None or e.chat_template in templates, e.id
        assert e.license and e.family, e.id


def test_the_cpu_entries_cover_the_small_chat_families_and_come_first():
    assert {e.family for e in CPU} >= FAMILIES_NEEDED
    assert all(0.1 <= e.params_b <= 8.5 for e in CPU)
    assert [e.target for e in catalog.entries()] == ["cpu"] * len(CPU) + ["gpu"] * len(GPU)
    assert catalog.entries()[0].embedded  # the default model stays first
    assert GPU and all(e.backbone and not e.gguf for e in GPU)  # the Medusa paper's entries are kept


@pytest.mark.parametrize("entry", [e for e in CPU if not e.embedded], ids=lambda e: e.id)
def test_a_cpu_entry_fetches_one_q4_gguf_file_and_names_its_safetensors_repo(entry):
    assert entry.sources == [entry.gguf] and entry.gguf.patterns == (entry.gguf_file,)
    assert entry.gguf_file.endswith(".gguf") and entry.quantization in catalog.GGUF_QUANTS
    assert entry.quantization.lower() in entry.gguf_file.lower()
    assert not entry.gguf.gated  # the GGUF mirrors are open, even where the official repo is gated
    assert entry.backbone is not None and entry.backbone.repo != entry.gguf.repo
    assert entry.gated is False and entry.heads is None and entry.eagle is None


def test_gated_is_what_the_hub_says_of_the_official_repos():
    gated = {e.family for e in CPU if e.backbone and e.backbone.gated}
    assert gated == {"llama3", "gemma3"}  # Meta's and Google's own repos; Qwen and SmolLM2 are open
    assert {e.id for e in GPU if e.gated} == {"mistral-7b-instruct-v0.2", "gemma-7b-it", "llama-3.1-8b-instruct"}
    assert not any("gated" in e.license for e in catalog.entries())  # said once, by the field


def test_memory_in_4bit_is_computed_from_the_parameter_count():
    # 4 bits a weight and a 16-bit step and minimum per 32 weights (GGUF Q4_1's form): 5 bits
    assert catalog.BITS_PER_WEIGHT_4BIT == 5.0
    assert memory_4bit_gb(8.0) == round(8.0 * 5 / 8 + catalog.RUNTIME_GB, 1) == 5.3
    for e in CPU:
        assert e.memory_gb_4bit == memory_4bit_gb(e.params_b), e.id
    for e in catalog.entries():  # a given figure (heads included) is never below the backbone's own
        assert e.params_b is None or e.memory_gb_4bit >= memory_4bit_gb(e.params_b), e.id
    # bigger models take more, and the file a CPU entry downloads fits its parameter count: a 4-bit
    # GGUF holds 4.5-8.5 bits a parameter (the small ones keep their large embedding at 6-8 bits)
    ordered = sorted(CPU, key=lambda e: e.params_b)
    assert [e.memory_gb_4bit for e in ordered] == sorted(e.memory_gb_4bit for e in ordered)
    for e in CPU:
        if not e.embedded:
            assert 4.5 <= e.download_gb * 8 / e.params_b <= 8.5, e.id


def test_draft_models_are_smaller_models_of_the_same_family():
    by_id = {e.id: e for e in catalog.entries()}
    by_repo = {e.backbone.repo: e for e in catalog.entries() if e.backbone}
    drafted = [e for e in catalog.entries() if e.draft_model]
    assert {e.id for e in drafted} >= {"qwen3-4b", "qwen3-8b", "qwen2.5-3b-instruct", "qwen2.5-7b-instruct",
                                       "llama-3.2-3b-instruct", "smollm2-1.7b-instruct", "gemma-3-1b-it",
                                       "gemma-3-4b-it"}  # fmt: skip
    for e in drafted:
        draft = by_id.get(e.draft_model) or by_repo.get(e.draft_model)
        if e.target == "cpu":
            assert draft is not None and draft.target == "cpu", e.id  # a catalog id, fetched as a GGUF too
        if draft is not None:
            assert draft.family == e.family and draft.params_b < e.params_b, e.id
        assert catalog.draft_for(e.id) == e.draft_model
    assert catalog.draft_for(catalog.entries()[0].id) is None and catalog.draft_for("no/such") is None


def test_published_eagle3_drafters_are_named_where_they_exist():
    eagle3 = {e.id: e.eagle3 for e in catalog.entries() if e.eagle3}
    assert eagle3["qwen3-1.7b"] == "AngelSlim/Qwen3-1.7B_eagle3"
    assert eagle3["llama-3.1-8b-instruct"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert all("/" in repo for repo in eagle3.values())
    assert catalog.find("qwen3-0.6b").drafter == "lookups"
    assert catalog.find("qwen3-4b").drafter == "EAGLE-3 AngelSlim/Qwen3-4B_eagle3, draft qwen3-0.6b"


def _bad(entry_id: str, **change) -> list[str]:
    entries = tuple(dataclasses.replace(e, **change) if e.id == entry_id else e for e in catalog.entries())
    return problems(entries)


@pytest.mark.parametrize(
    ("entry_id", "change", "says"),
    [
        ("qwen3-4b", {"id": "qwen3-8b"}, "used twice"),
        ("qwen3-4b", {"draft_model": "llama-3.2-1b-instruct"}, "of family llama3, not qwen3"),
        ("qwen3-0.6b", {"draft_model": "qwen3-8b"}, "not smaller"),
        ("qwen3-4b", {"draft_model": "no-such-model"}, "no catalog id nor hub repo"),
        ("qwen3-4b", {"gguf": Source("unsloth/Qwen3-4B-GGUF", "main", ("*.gguf",))}, "one file name"),
        ("qwen3-4b", {"gguf": Source("unsloth/Qwen3-4B-GGUF", "main", ("Qwen3-4B-Q8_0.gguf",))}, "not one of"),
        ("qwen3-4b", {"gguf": None}, "needs params_b and a gguf source"),
        ("qwen3-4b", {"target": "tpu"}, "target 'tpu'"),
        ("gemma-7b-it", {"target": "cpu"}, "cpu entries must come before"),
        ("gemma-7b-it", {"memory_gb_4bit": 1.0}, "less than its 8.54B parameters take"),
        ("qwen3-4b", {"family": ""}, "no family"),
        ("qwen3-4b", {"id": "Qwen3 4B"}, "an id is lower-case"),
    ],
)
def test_the_checks_catch_each_mistake(entry_id, change, says):
    found = _bad(entry_id, **change)
    assert any(says in p for p in found), found


def test_the_quant_type_is_read_from_the_file_name():
    assert catalog._quant_of("qwen2.5-3b-instruct-q4_k_m.gguf") == "Q4_K_M"
    assert catalog._quant_of("gemma-3-1b-it-Q4_0.gguf") == "Q4_0"
    assert catalog._quant_of("model-Q4_0_4_4.gguf") is None  # another type, not Q4_0
    assert catalog._quant_of("model-IQ4_XS.gguf") is None and catalog._quant_of("Q8_0.gguf") is None


def test_models_lists_the_cpu_entries_first_with_memory_license_gated_and_drafters(capsys, monkeypatch):
    from app.cli import catalog as cli
    from models import hub, on_disk

    monkeypatch.setattr(hub, "cached_state", lambda sources: "not cached")
    monkeypatch.setattr(on_disk, "find", lambda: [])
    assert cli.run_models(None) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = {e.id: next(line for line in lines if line.startswith(e.id + " ")) for e in catalog.entries()}
    assert max(lines.index(rows[e.id]) for e in CPU) < lines.index(next(x for x in lines if x.startswith("For a GPU")))
    assert lines.index(next(x for x in lines if x.startswith("For a CPU"))) < min(lines.index(r) for r in rows.values())
    for e in catalog.entries():
        row = rows[e.id]
        assert e.license in row and e.drafter in row and e.quantization in row, row
        assert cli._gb(e.memory_gb_4bit) in row and ("yes" if e.gated else "no") in row.split()
    assert "AngelSlim/Qwen3-1.7B_eagle3" in rows["qwen3-1.7b"] and "1.4 GB" in rows["qwen3-1.7b"]
    assert "yes" in rows["llama-3.1-8b-instruct"].split() and "no" in rows["llama-3.2-1b-instruct"].split()


def test_a_cpu_entry_resolves_by_fetching_its_gguf_file_alone(tmp_path, monkeypatch):
    """`--model ID`: the one GGUF file comes through the hub code (not the other quants, the README
    or the safetensors repo), lands in the hub cache and opens as any GGUF file; again: no download."""
    from models import hub, loader
    from tests.fake_hub import FakeHub
    from tests.test_gguf_files import write_gguf

    entry = next(e for e in CPU if e.gguf and e.backbone.gated)  # a gated official repo: never asked for
    write_gguf(tmp_path / "tiny.gguf", "Q4_0")
    data = (tmp_path / "tiny.gguf").read_bytes()
    files = {entry.gguf_file: data, "other-Q8_0.gguf": data[::-1], "README.md": b"# quants", "config.json": b"{}"}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))  # the GGUF conversion cache
    fetch = hub.fetch
    with FakeHub({entry.gguf.repo: files}) as fake:
        monkeypatch.setattr(hub, "fetch", lambda *a, **k: fetch(*a, **k, cache_dir=tmp_path / "hub", endpoint=fake.url))
        spec = loader.resolve(entry.id)
        gets = fake.file_gets()
        assert len(gets) == 1 and gets[0].endswith(f"/{entry.gguf_file}"), gets
        assert not any(entry.backbone.repo in p for _, p, _ in fake.requests)
        file = Path(spec.name)
        assert file.name == entry.gguf_file and file.read_bytes() == data
        assert file.is_relative_to(tmp_path / "hub")
        assert spec.heads_folder is None and spec.tree == entry.tree
        assert loader.resolve(entry.id) == spec and len(fake.file_gets()) == 1  # cached: nothing fetched again
