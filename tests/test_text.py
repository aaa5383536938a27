from core.text import Detokenizer


class Utf8Bytes:
    """One token per byte, like a byte-level tokenizer's fallback tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_split_across_tokens_come_out_whole():
    detok = Detokenizer(Utf8Bytes())
    text = "née 🙂 ok"
    data = list(text.encode())
    deltas = [detok.push([b]) for b in data]
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + detok.flush() == text
    emoji_start = len("née ".encode())
    assert deltas[emoji_start : emoji_start + 3] == ["", "", ""]  # held back until complete
    assert deltas[emoji_start + 3] == "🙂"


def test_flush_returns_an_incomplete_tail():
    detok = Detokenizer(Utf8Bytes())
    assert detok.push(list(b"a") + [0xF0, 0x9F]) == ""
    assert detok.flush() == "a\ufffd"


def test_no_tokenizer_gives_no_text():
    detok = Detokenizer(None)
    assert detok.push([1, 2]) == "" and detok.flush() == ""
