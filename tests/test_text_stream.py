"""Incremental detokenization: the same text as decoding everything at once, stop strings
never emitted, and constant work per token."""

from __future__ import annotations

import pytest

from mooncake.api.text_stream import TextStream

TEXT = ("Hello wörld! 🙂🙂 你好，世界。 Ünïcödé tëxt with emojis 🎉🚀 and   spaces.\n\n"
        "def f(x):\n    return x ** 2  # code\n") * 3


@pytest.fixture(scope="module")
def tok(loaded_model):
    return loaded_model.tokenizer


def run(stream: TextStream, ids: list[int], step: int = 1) -> str:
    out = "".join(stream.push(ids[i:i + step]) for i in range(0, len(ids), step))
    return out + stream.flush()


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_text_equals_decoding_all_ids(tok, step):
    ids = tok.encode(TEXT)
    assert run(TextStream(tok), ids, step) == tok.decode(ids, skip_special_tokens=True)


def test_an_incomplete_character_is_held_until_it_completes(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1  # a byte-level tokenizer splits the emoji
    s = TextStream(tok)
    assert all(s.push([i]) == "" for i in ids[:-1])
    assert s.push(ids[-1:]) == "🎉"


@pytest.mark.parametrize("stop", ["世界", "emojis 🎉", "\n\ndef"])
def test_stop_strings_end_the_text_and_are_never_emitted(tok, stop):
    ids = tok.encode(TEXT)
    s = TextStream(tok, [stop, "never-there"])
    out = run(s, ids)
    assert s.stopped and out == TEXT[:TEXT.index(stop)]


def test_work_per_token_does_not_grow_with_the_output(tok):
    class Counting:
        def __init__(self) -> None:
            self.ids = 0

        def decode(self, ids, skip_special_tokens=True):
            self.ids += len(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(TEXT * 20)
    counting = Counting()
    run(TextStream(counting), ids)
    assert counting.ids < 8 * len(ids)  # a full re-decode per token would be ~len(ids)**2 / 2


class CountingDecodes:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok) -> None:
        self.tok, self.ids = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["special", "lead byte"])
def test_ids_that_add_no_text_cost_linear_work_and_keep_the_text_exact(tok, kind):
    """Special tokens (skipped) or lone UTF-8 lead bytes (never complete), as ``logit_bias`` can
    force: 4× the ids cost at most 6× the decoding (each id re-decoded would be 16×), and the text
    is what decoding everything at once gives, a word after them included."""
    filler = tok.eos_token_id if kind == "special" else tok.convert_tokens_to_ids("Ã")  # byte 0xC3: a lead
    assert tok.decode([filler], skip_special_tokens=True) == ("" if kind == "special" else "\ufffd")
    work = []
    for n in (300, 1200):
        ids = tok.encode("Hi") + [filler] * n + tok.encode(" there")
        counting = CountingDecodes(tok)
        assert run(TextStream(counting), ids) == tok.decode(ids, skip_special_tokens=True)
        work.append(counting.ids)
    assert work[1] <= 6 * work[0]
