from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.text import Detokenizer
from tests.helpers import plain_tokens, tiny_backend


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


def test_flush_drops_an_incomplete_character_at_the_end():
    """Old: "a\ufffd", the reply ended in U+FFFD."""
    detok = Detokenizer(Utf8Bytes())
    assert detok.push(list(b"a") + [0xF0, 0x9F]) == ""
    assert detok.flush() == "a" and detok.text == "a"
    detok = Detokenizer(Utf8Bytes())
    assert detok.push(list("née".encode())) == "née" and detok.push([0xE2, 0x82]) == ""  # "€" cut after 2 bytes
    assert detok.flush() == "" and detok.text == "née"


def test_flush_keeps_a_complete_tail():
    detok = Detokenizer(Utf8Bytes())
    detok.push([0xF0, 0x9F, 0x99])
    assert detok.push([0x82]) == "🙂" and detok.flush() == ""
    detok = Detokenizer(Utf8Bytes())
    detok.push(list(b"ab"))
    assert detok.flush() == "" and detok.text == "ab"


class Table:
    """Each token's bytes from a table ("x" for the others), decoded as a byte-level tokenizer does."""

    def __init__(self, table: dict[int, bytes]) -> None:
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.table.get(i, b"x") for i in ids).decode("utf-8", errors="replace")


def test_a_reply_cut_at_its_token_limit_mid_character_does_not_end_in_ufffd():
    """Old: the reply's text ended in U+FFFD when max_new_tokens cut a character in two."""
    backend, prompt, n = tiny_backend(), [1, 2, 3, 4], 6
    ids = plain_tokens(backend, prompt, n)
    decoder = Table({ids[-1]: "€".encode()[:2]})  # the reply's last token: two of the three bytes of "€"
    events, done = collect(stream(backend, prompt, DecodeSettings(max_new_tokens=n), None, decoder))
    assert list(done.token_ids) == ids and done.finish_reason == "length"
    assert not done.text.endswith("\ufffd") and done.text == decoder.decode(ids[:-1])
    assert "".join(e.text for e in events) == done.text  # what was streamed is what is kept


def test_no_tokenizer_gives_no_text():
    detok = Detokenizer(None)
    assert detok.push([1, 2]) == "" and detok.flush() == ""
