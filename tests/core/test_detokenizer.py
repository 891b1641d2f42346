from __future__ import annotations

from pathlib import Path

from pocketllm.detokenizer import IncrementalDetokenizer, StopMatcher


class ByteTokenizer:
    """Each token is one UTF-8 byte; decoding replaces incomplete sequences with U+FFFD like real tokenizers."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_never_emits_half_a_multibyte_character() -> None:
    text = "añ😀中b"
    detok = IncrementalDetokenizer(ByteTokenizer(), list(b"> "), skip_special_tokens=True)
    pieces = [detok.add([b]) for b in text.encode()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text
    assert pieces[text.encode().index("😀".encode()) + 3] == "😀"  # emitted once its fourth byte arrived


def test_flush_returns_incomplete_tail() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), [], skip_special_tokens=True)
    assert detok.add(list("é".encode()[:1])) == ""
    assert detok.flush() == "\ufffd"


def test_real_tokenizer_stream_equals_full_decode(pocketllm_tiny_llama: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pocketllm_tiny_llama / "tokenizer.json"))
    ids = tok.encode("Grüße, 世界! 😀 emoji and   spaces\nnew line").ids
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == tok.decode(ids)


def test_stop_matcher_finds_earliest_stop_across_chunks() -> None:
    matcher = StopMatcher(["END", "\n\n"], include_stop=False)
    assert matcher.find("hello E", 1) is None
    assert matcher.safe_length("hello E") == len("hello E") - 2  # "E" may start "END"
    assert matcher.find("hello EN\n\nD END", 8) == (8, "\n\n")
    assert StopMatcher(["END"], include_stop=True).find("xxEND", 2) == (5, "END")
    assert StopMatcher([], include_stop=False).safe_length("abc") == 3
