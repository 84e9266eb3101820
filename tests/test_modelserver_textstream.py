"""Stop strings and UTF-8-safe incremental detokenization, without a model."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from modelserver.textstream import IncrementalDetokenizer, StopMatcher


class ByteTokenizer:
    """A byte-level tokenizer: each token is some bytes; decoding broken UTF-8 gives U+FFFD, like BPE models."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = list(pieces)

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def stream_text(detok: IncrementalDetokenizer, ids: Sequence[int], step: int = 1) -> list[str]:
    deltas = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    return deltas


def test_multibyte_character_split_over_tokens_is_never_emitted_broken() -> None:
    text = "héllo wörld 🙂!"
    data = text.encode()
    tokenizer = ByteTokenizer([data[i : i + 1] for i in range(len(data))])  # one byte per token
    deltas = stream_text(IncrementalDetokenizer(tokenizer.decode), list(range(len(data))))
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text
    assert "🙂" in deltas  # the 4-byte emoji arrives whole, in one delta


def test_plain_ascii_is_emitted_token_by_token() -> None:
    tokenizer = ByteTokenizer([b"Hel", b"lo", b" wor", b"ld"])
    deltas = stream_text(IncrementalDetokenizer(tokenizer.decode), [0, 1, 2, 3])
    assert deltas == ["Hel", "lo", " wor", "ld", ""]


def test_several_ids_per_push() -> None:
    data = "ça va? ✓".encode()
    tokenizer = ByteTokenizer([data[i : i + 1] for i in range(len(data))])
    deltas = stream_text(IncrementalDetokenizer(tokenizer.decode), list(range(len(data))), step=3)
    assert "".join(deltas) == "ça va? ✓"
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize(("window", "context"), [(2, 1), (4, 2), (16, 4)])
def test_a_sliding_window_gives_the_same_text_as_one_decode(window: int, context: int) -> None:
    text = "Zoë's café — naïve façade, 🙂 déjà vu! " * 8
    data = text.encode()
    pieces = [data[i : i + 2] for i in range(0, len(data), 2)]  # two bytes per token: characters straddle tokens
    tokenizer = ByteTokenizer(pieces)
    calls: list[int] = []

    def counting_decode(ids: Sequence[int]) -> str:
        calls.append(len(ids))
        return tokenizer.decode(ids)

    deltas = stream_text(
        IncrementalDetokenizer(counting_decode, window=window, context=context), list(range(len(pieces)))
    )
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert max(calls) <= window + context + 2  # bounded work per push, whatever the length
    assert len(calls) < 1.5 * len(pieces)


def test_flush_releases_an_incomplete_character_at_the_end() -> None:
    tokenizer = ByteTokenizer([b"ok", "é".encode()[:1]])
    detok = IncrementalDetokenizer(tokenizer.decode)
    assert detok.push([0, 1]) == ""  # "ok" + half a character: held back as a whole
    assert detok.flush() == "ok\ufffd"
    assert detok.token_count == 2


def test_a_decoder_that_drops_a_leading_space_keeps_the_space_between_tokens() -> None:
    pieces = ["▁Hello", "▁big", "▁world"]

    def decode(ids: Sequence[int]) -> str:  # sentencepiece style: a leading "▁" of the decode is dropped
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    deltas = stream_text(IncrementalDetokenizer(decode), [0, 1, 2])
    assert "".join(deltas) == "Hello big world"


def feed(matcher: StopMatcher, pieces: Sequence[str]) -> str:
    out = "".join(matcher.push(piece) for piece in pieces)
    return out + matcher.flush()


def test_stop_string_split_over_deltas_is_not_leaked() -> None:
    matcher = StopMatcher(["STOP"])
    emitted = [matcher.push(piece) for piece in ["Hello S", "T", "OP and more"]]
    assert emitted == ["Hello ", "", ""]
    assert matcher.stopped
    assert matcher.flush() == ""


def test_held_text_is_released_when_the_stop_string_does_not_complete() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("a ST") == "a "
    assert matcher.push("ART") == "START"
    assert not matcher.stopped


def test_held_text_is_released_at_the_end_of_the_stream() -> None:
    assert feed(StopMatcher(["\n\n"]), ["line", "\n"]) == "line\n"


def test_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopMatcher(["world", "lo w"])
    assert matcher.push("hello world") == "hel"
    assert matcher.stopped


def test_text_after_the_stop_is_ignored() -> None:
    matcher = StopMatcher(["."])
    assert matcher.push("One. Two.") == "One"
    assert matcher.push(" Three") == ""


@pytest.mark.parametrize(
    ("pieces", "stops", "expected"),
    [
        (["abc"], [], "abc"),
        (["a", "b", "c", "d"], ["bc"], "a"),
        (["xy", "yxx", "y"], ["xxy"], "xyy"),
        (["aaab"], ["aab"], "a"),
        (["é", "à", "ü"], ["àü"], "é"),
    ],
)
def test_stream_equals_cutting_the_whole_text(pieces: list[str], stops: list[str], expected: str) -> None:
    assert feed(StopMatcher(stops), pieces) == expected
    whole = "".join(pieces)
    cuts = [whole.find(s) for s in stops if s in whole]
    assert expected == (whole[: min(cuts)] if cuts else whole)
