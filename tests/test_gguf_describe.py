"""A GGUF file's description, written once by a process of its own: its tokenizer's merges in the
compact form, the architectures it may be of, and the one sentence the describing process says
where it cannot read a file."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("spaced", [False, True], ids=["compacted", "a-token-with-a-space"])
def test_a_descriptions_merges_are_compacted_and_tokenize_the_same(tmp_path, spaced):
    """Merges written as "a b" strings (a smaller load) tokenize as the pairs did; a vocabulary
    whose merged tokens hold a space keeps its pairs (a string would not split back)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from models.gguf_tokenizer import compact_merges

    text = ["the quick brown fox jumps over the lazy dog", "a tokenizer's merges, merged again and again"] * 50
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    if not spaced:
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    file = tmp_path / "tokenizer.json"
    tokenizer.save(str(file))
    pairs = json.loads(file.read_text(encoding="utf-8"))["model"]["merges"]
    assert pairs and all(isinstance(m, list) for m in pairs)
    assert any(" " in part for m in pairs for part in m) == spaced

    compact_merges(file)
    merges = json.loads(file.read_text(encoding="utf-8"))["model"]["merges"]
    assert merges == (pairs if spaced else [f"{a} {b}" for a, b in pairs])
    compacted = Tokenizer.from_file(str(file))
    for line in text[:2] + ["foxes jump; dogs are lazy", "qqq zz"]:
        assert compacted.encode(line).ids == tokenizer.encode(line).ids


def test_the_architectures_served_from_gguf_are_transformers_own():
    """`supported_architectures` (read without transformers' conversion table, whose import brings
    its loading machinery) equals transformers' tables, its conversion table's included."""
    from transformers.integrations.gguf import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from models.gguf_files import NOT_CAUSAL, supported_architectures

    assert supported_architectures() == (set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_ARCHS)) - NOT_CAUSAL


def test_the_describing_process_says_one_sentence_where_it_cannot_read_a_file(tmp_path, monkeypatch, capsys):
    """A file is described by a process of its own: its UserError's sentence (last on its stderr,
    exit status 2) becomes this process's, a crash is said in one sentence too, and on success its
    warnings are passed on. The process itself: `_main` says the sentence and exits 2."""
    import subprocess

    from core.errors import UserError
    from models import gguf_files

    def ran(code: int, err: str):
        return lambda *a, **k: subprocess.CompletedProcess(a[0], code, "", err)

    monkeypatch.setattr(gguf_files.subprocess, "run", ran(2, "a warning\nX.gguf could not be read (KeyError: 'x').\n"))
    with pytest.raises(UserError, match=r"^X.gguf could not be read \(KeyError: 'x'\)\.$"):
        gguf_files._write_description(tmp_path / "X.gguf", tmp_path)
    monkeypatch.setattr(gguf_files.subprocess, "run", ran(-11, ""))
    with pytest.raises(UserError, match=r"could not be read: the reading stopped \(exit status -11\)\.$"):
        gguf_files._write_description(tmp_path / "X.gguf", tmp_path)
    monkeypatch.setattr(gguf_files.subprocess, "run", ran(0, "a tokenizer warning\n"))
    gguf_files._write_description(tmp_path / "X.gguf", tmp_path)
    assert capsys.readouterr().err == "a tokenizer warning\n"
    monkeypatch.undo()

    def refuses(gguf, folder):
        raise UserError(f"{gguf} could not be read.")

    monkeypatch.setattr(gguf_files, "_describe_here", refuses)
    assert gguf_files._main([str(tmp_path / "Y.gguf"), str(tmp_path)]) == gguf_files.USER_ERROR
    assert capsys.readouterr().err == f"{tmp_path / 'Y.gguf'} could not be read.\n"
