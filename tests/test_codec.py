"""The codec calls the Rust tokenizer directly only where it gives what transformers' wrapper
gives: the same ids for every prompt, the same text for every id sequence."""

from __future__ import annotations

import copy
import random

import pytest

from mooncake.api.text_codec import Codec
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


async def test_a_short_prompt_never_waits_behind_large_ones(tok):
    """Tokenizer lanes (mooncake/api/prompts.py): while every large-prompt thread is busy with a
    client's megabyte prompts, a short prompt is tokenized at once, and large ones still are."""
    import asyncio
    import threading

    from mooncake.api.prompts import SMALL_CHARS, Prompts

    release = threading.Event()
    codec = Codec(tok)
    encode = codec.encode

    def slow_for_large(text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > SMALL_CHARS:
            release.wait(30)
        return encode(text, add_special_tokens)

    codec.encode = slow_for_large  # type: ignore[method-assign]
    prompts = Prompts(tok, codec, large_threads=2)
    try:
        large = [asyncio.create_task(prompts.completion("word " * SMALL_CHARS)) for _ in range(4)]
        await asyncio.sleep(0.05)
        short = await asyncio.wait_for(prompts.completion("Hello there"), 5)
        assert short == encode("Hello there") and not any(t.done() for t in large)
        release.set()
        assert all(len(ids) >= SMALL_CHARS for ids in await asyncio.gather(*large))
    finally:
        release.set()
        prompts.close()
