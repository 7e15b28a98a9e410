"""The codec calls the Rust tokenizer directly only where it gives what transformers' wrapper
gives: the same ids for every prompt, the same text for every id sequence."""

from __future__ import annotations

import copy
import random

import pytest

from mooncake.api.codec import Codec
from mooncake.api.text_stream import TextStream

TEXTS = ["Hello wörld! 🙂 你好，世界。\n\ndef f(x):\n    return x ** 2\n", "<|im_start|>user\nhi<|im_end|>\n",
         "", "   leading spaces", "tabs\tand\r\nreturns", "a" * 3000, "The quick brown fox. " * 100]


@pytest.fixture(scope="module")
def tok(loaded_model):
    return loaded_model.tokenizer


def test_the_bundled_tokenizer_is_encoded_and_decoded_directly_with_the_wrappers_results(tok):
    codec = Codec(tok)
    assert codec.direct
    for text in TEXTS:
        for special in (True, False):
            assert codec.encode(text, special) == tok.encode(text, add_special_tokens=special)
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 9))]
        for skip in (True, False):
            assert codec.decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_truncation_left_on_the_wrapper_does_not_reach_the_codec(tok):
    codec = Codec(tok)
    tok(TEXTS[-1], truncation=True, max_length=8)  # sets truncation on the wrapper's Rust tokenizer
    try:
        assert len(codec.encode(TEXTS[-1])) == len(tok.encode(TEXTS[-1])) > 8
    finally:
        tok.backend_tokenizer.no_truncation()


def test_a_tokenizer_that_cleans_up_spaces_goes_through_the_wrapper(tok):
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    codec = Codec(cleaning)
    assert not codec.direct
    ids = tok.encode("Hello , world !")
    assert codec.decode(ids) == cleaning.decode(ids) and codec.encode("x y") == tok.encode("x y")


def test_a_stream_on_the_codec_gives_the_wrappers_text(tok):
    ids = tok.encode(TEXTS[0] * 3)
    stream = TextStream(Codec(tok))
    out = "".join(stream.push([i]) for i in ids) + stream.flush()
    assert out == tok.decode(ids, skip_special_tokens=True)
