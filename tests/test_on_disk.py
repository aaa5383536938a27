"""Models already on this machine: Ollama's store, LM Studio's folder and the Hugging Face cache,
planted in tmp_path with small GGUF files written by `gguf.GGUFWriter` (and damaged ones), listed
by `models.on_disk`, printed by `medusa-chat models` and offered by the chat page's model picker."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from app import ui
from app.engine import Engine
from app.main import main
from app.ui_session import on_disk_choices
from core.errors import UserError
from models import catalog, on_disk

Q = gguf.GGMLQuantizationType
VOCAB = 3000  # tokens, scores and merges before general.file_type: the header reader must skip them


def write_gguf(path: Path, arch: str = "llama", file_type: int | None = None, tensor_type: Q = Q.Q8_0) -> int:
    """A tiny model file: a vocabulary, then metadata, then a few tensors. Returns its parameters."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(path.stem)
    w.add_token_list([f"tok{i}" for i in range(VOCAB)])
    w.add_token_scores([0.5] * VOCAB)
    w.add_token_merges([f"t o{i}" for i in range(VOCAB)])
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_block_count(1)
    rng, shapes = np.random.default_rng(0), {"token_embd.weight": (8, 256), "blk.0.attn_q.weight": (4, 256)}
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        if tensor_type == Q.Q4_K:  # no writer for K-quants: their bytes, at their size (only headers are read)
            block, size = gguf.GGML_QUANT_SIZES[Q.Q4_K]
            w.add_tensor(name, rng.integers(0, 255, (shape[0], shape[1] // block * size), np.uint8), raw_dtype=Q.Q4_K)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, tensor_type), raw_dtype=tensor_type)
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 8 * 256 + 4 * 256 + 256


def ollama_model(root: Path, parts: str, blob: Path | None) -> None:
    """A manifest at manifests/<registry>/<namespace>/<model>/<tag>, its model layer the blob's digest."""
    digest = "sha256:" + (hashlib.sha256(blob.read_bytes()).hexdigest() if blob else "0" * 64)
    if blob is not None:
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        blob.rename(root / "blobs" / digest.replace(":", "-"))
    layers = [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64},
              {"mediaType": "application/vnd.ollama.image.model", "digest": digest}]  # fmt: skip
    manifest = root / "manifests" / parts
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


def hub_file(hub: Path, repo: str, name: str, write) -> Path:
    """A file in the hub cache's layout: the blob, and the snapshot's link to it named by refs/main."""
    repo_dir = hub / f"models--{repo.replace('/', '--')}"
    blob = repo_dir / "blobs" / hashlib.sha1(name.encode()).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    write(blob)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text("abc123")
    link = repo_dir / "snapshots" / "abc123" / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(Path("..", "..", "blobs", blob.name))
    return link


@pytest.fixture
def planted(tmp_path, monkeypatch) -> SimpleNamespace:
    """The three tools' folders, each with good and bad models; the environment points at them."""
    home, store, hub = tmp_path / "home", tmp_path / "ollama", tmp_path / "hub"
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    p = SimpleNamespace(store=store, hub=hub)

    p.params = write_gguf(tmp_path / "a", file_type=gguf.LlamaFileType.MOSTLY_Q8_0)
    ollama_model(store, "registry.ollama.ai/library/tiny/latest", tmp_path / "a")
    write_gguf(tmp_path / "b", "qwen3", gguf.LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K)
    ollama_model(store, "hf.co/someone/Tiny-GGUF/Q4_K_M", tmp_path / "b")
    ollama_model(store, "registry.ollama.ai/library/gone/1b", None)

    studio = home / ".lmstudio" / "models" / "pub" / "Tiny-GGUF"
    write_gguf(studio / "tiny-Q4_0.gguf", "mistral", gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_0)
    write_gguf(studio / "encoder.gguf", "bert", gguf.LlamaFileType.MOSTLY_Q8_0)
    whole = (studio / "tiny-Q4_0.gguf").read_bytes()
    (studio / "cut.gguf").write_bytes(whole[: len(whole) - 1000])  # the tensors' end is missing
    (studio / "head.gguf").write_bytes(whole[:5000])  # it ends in the vocabulary
    (studio / "notes.gguf").write_text("not a model, a text file someone named .gguf")
    write_gguf(home / ".cache" / "lm-studio" / "models" / "old" / "repo" / "older.gguf", "gemma3", None, Q.Q8_0)

    hub_file(hub, "org/tiny-gguf", "tiny.Q8_0.gguf", lambda f: write_gguf(f, "qwen2", None, Q.Q8_0))
    weights = {"model.embed_tokens.weight": np.zeros((16, 8), np.float32), "lm_head.weight": np.zeros((16, 8))}
    hub_file(hub, "org/tiny-st", "model.safetensors", lambda f: save_file(weights, str(f)))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    hub_file(hub, "org/tiny-st", "config.json", lambda f: f.write_text(json.dumps(config)))
    catalog_repo = next(e.sources[0].repo for e in catalog.entries() if e.sources)  # the catalog lists it already
    hub_file(hub, catalog_repo, "model.safetensors", lambda f: save_file(weights, str(f)))
    hub_file(hub, catalog_repo, "config.json", lambda f: f.write_text(json.dumps(config)))
    return p


def by_name() -> dict[str, on_disk.Found]:
    found = on_disk.find()
    assert len({f.name for f in found}) == len(found)
    return {f.name: f for f in found}


def test_the_three_layouts_are_listed_with_size_quantization_and_architecture(planted):
    found = by_name()
    assert set(found) == {
        "tiny:latest", "hf.co/someone/Tiny-GGUF:Q4_K_M", "gone:1b",
        "pub/Tiny-GGUF/tiny-Q4_0.gguf", "pub/Tiny-GGUF/encoder.gguf", "pub/Tiny-GGUF/cut.gguf",
        "pub/Tiny-GGUF/notes.gguf", "pub/Tiny-GGUF/head.gguf", "old/repo/older.gguf", "org/tiny-gguf/tiny.Q8_0.gguf",
        "org/tiny-st",
    }  # fmt: skip
    good = {name: (f.source, f.architecture, f.quantization) for name, f in found.items() if not f.problem}
    assert good == {
        "tiny:latest": ("Ollama", "llama", "Q8_0"),
        "hf.co/someone/Tiny-GGUF:Q4_K_M": ("Ollama", "qwen3", "Q4_K_M"),  # general.file_type, by its name
        "pub/Tiny-GGUF/tiny-Q4_0.gguf": ("LM Studio", "mistral", "Q4_0"),
        "old/repo/older.gguf": ("LM Studio", "gemma3", "Q8_0"),  # no file type: the tensors' dominant type
        "org/tiny-gguf/tiny.Q8_0.gguf": ("Hugging Face cache", "qwen2", "Q8_0"),
        "org/tiny-st": ("Hugging Face cache", "llama", "BF16"),
    }
    tiny = found["tiny:latest"]
    assert tiny.path.parent == planted.store / "blobs" and tiny.ref == str(tiny.path)  # opened in place
    assert tiny.size == tiny.path.stat().st_size and tiny.parameters == planted.params
    hub_gguf = found["org/tiny-gguf/tiny.Q8_0.gguf"]
    assert hub_gguf.ref.endswith("snapshots/abc123/tiny.Q8_0.gguf") and hub_gguf.size == hub_gguf.path.stat().st_size
    st = found["org/tiny-st"]
    assert (
        st.ref == "org/tiny-st"
        and st.parameters == 2 * 16 * 8
        and st.size == (st.path / "model.safetensors").stat().st_size
    )


def test_damaged_and_unsupported_files_say_why_in_one_sentence(planted):
    found = by_name()
    problems = {name: f.problem for name, f in found.items() if f.problem}
    assert set(problems) == {
        "gone:1b",
        "pub/Tiny-GGUF/encoder.gguf",
        "pub/Tiny-GGUF/cut.gguf",
        "pub/Tiny-GGUF/notes.gguf",
        "pub/Tiny-GGUF/head.gguf",
    }
    assert "missing" in problems["gone:1b"]
    assert problems["pub/Tiny-GGUF/encoder.gguf"] == "the architecture bert is not one this app can load."
    cut = found["pub/Tiny-GGUF/cut.gguf"]
    assert (
        problems["pub/Tiny-GGUF/cut.gguf"]
        == f"the file is truncated ({cut.size:,} of the {cut.size + 1000:,} bytes its header describes)."
    )
    assert problems["pub/Tiny-GGUF/head.gguf"] == "the file ends inside its header (truncated or damaged)."
    assert problems["pub/Tiny-GGUF/notes.gguf"] == "it is not a GGUF file."
    for p in problems.values():
        assert p.endswith(".") and p.count(". ") == 0 and "\n" not in p
    assert found["pub/Tiny-GGUF/encoder.gguf"].architecture == "bert"  # what the header says is still shown


def test_a_broken_link_a_bad_manifest_and_an_unreadable_folder_never_stop_the_listing(planted, monkeypatch):
    link = planted.hub / "models--org--tiny-gguf" / "snapshots" / "abc123" / "lost.gguf"
    link.symlink_to("../../blobs/not-there")
    (planted.store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "bad").write_text("{not json")
    found = by_name()
    assert "missing" in found["org/tiny-gguf/lost.gguf"].problem
    assert found["tiny:bad"].problem == "its manifest is damaged."
    assert not found["tiny:latest"].problem

    def broken(root):
        raise PermissionError(root)

    monkeypatch.setattr(on_disk, "lmstudio", broken)
    names = set(by_name())
    assert "tiny:latest" in names and "org/tiny-st" in names and not any(n.startswith("pub/") for n in names)


def test_nothing_planted_lists_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "none"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "none"))
    assert on_disk.find() == []


def test_medusa_chat_models_prints_them_after_the_catalog(planted, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    catalog_end, section = out.index(catalog.entries()[-1].id), out.index("On this machine")
    assert catalog_end < section
    lines = out[section:].splitlines()
    for f in on_disk.find():
        row = next(line for line in lines if line.strip().startswith(f.name + " "))
        assert row.rstrip().endswith(f.ref) and on_disk.size_text(f.size) in row
        assert (f.quantization or "—") in row and (f.architecture or "—") in row
        if f.problem:
            assert f"cannot open: {f.problem}" in lines[lines.index(row) + 1]
    tiny = next(f for f in on_disk.find() if f.name == "tiny:latest")
    assert f"{tiny.parameters / 1e3:.1f}K" in next(line for line in lines if "tiny:latest" in line)


class PickEngine(Engine):
    """An Engine that loads nothing: `load` records the --model string chosen and, for a damaged
    file, raises the one sentence a loader gives."""

    def load(self, model: str, on_progress=None) -> None:
        self.__dict__.setdefault("loads", []).append(model)
        if "cut.gguf" in model:
            raise UserError(f"{model} is truncated: it ends before its tensors do.")


def test_the_picker_offers_them_by_name_size_and_quantization(planted):
    choices = dict((value, label) for label, value in on_disk_choices())
    found = by_name()
    tiny, cut = found["tiny:latest"], found["pub/Tiny-GGUF/cut.gguf"]
    assert choices[tiny.ref] == f"tiny:latest · {on_disk.size_text(tiny.size)} · Q8_0 · Ollama"
    assert choices["org/tiny-st"].startswith("org/tiny-st · ") and "BF16" in choices["org/tiny-st"]
    assert "cannot open: the file is truncated" in choices[cut.ref]
    assert set(choices) == {f.ref for f in found.values()}
    model_choices = ui._model_choices()  # the catalog first, then these
    assert [v for _, v in model_choices[: len(catalog.entries())]] == [e.id for e in catalog.entries()]
    assert model_choices[len(catalog.entries()) :] == on_disk_choices()


def test_the_page_offers_them_and_choosing_one_loads_it_or_says_why(planted, home):
    engine = PickEngine(catalog.entries()[0].id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        demo = ui.build(engine)
    picker = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "model")
    fns = {f.name: f for f in demo.fns.values()}
    found = by_name()
    tiny, cut = found["tiny:latest"], found["pub/Tiny-GGUF/cut.gguf"]
    values = [v for _, v in picker.choices]
    assert tiny.ref in values and cut.ref in values and "org/tiny-st" in values
    note = fns["describe"].fn(tiny.ref)  # Markdown showing the names as text
    assert note.startswith("tiny\\:latest (Ollama): ") and "Q8\\_0\\, llama\\, 3\\.3K parameters" in note
    assert "opened in place from" in note
    assert "truncated" in fns["describe"].fn(cut.ref)
    fns["switch"].fn(tiny.ref)
    with pytest.warns(UserWarning, match="is truncated: it ends before its tensors do"):
        status = fns["switch"].fn(cut.ref)  # the loader's sentence, and the page goes on
    assert engine.loads == [tiny.ref, cut.ref] and status == engine.status()
