"""Every family on the engine's own forward against transformers, on tiny random models:
float32 greedy tokens and logits exact, bf16 close; chunked prefill across sliding windows,
batched decode, prefix blocks shared under a window; refusals of what the forward cannot run."""

from __future__ import annotations

import pytest
import torch

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, ModelLoadError, load_model
from mooncake.engine.model.families import check_config, model_spec
from mooncake.engine.loading.tiny_models import FAMILIES, tiny_config
from mooncake.protocol import Sampling
from mooncake.testing.engine_run import run_alone

STEPS = 24
GREEDY = Sampling(max_tokens=STEPS, temperature=0, ignore_eos=True)
TEXT = ("Paged attention keeps keys and values in fixed-size blocks that many requests can share, "
        "and a sliding window only looks back a few tokens. ")


def prompts(tok) -> list[list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_dict=True)["input_ids"]
    return [tok("Once upon a time")["input_ids"], list(chat), tok(TEXT * 4)["input_ids"][:100]]


def oracle(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def hf_greedy(model, ids: list[int], n: int = STEPS):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [x[0].float() for x in out.logits]


def run(engine: Engine, ids: list[int], sampling: Sampling = GREEDY) -> list[int]:
    return run_alone(engine, ids, sampling)


def last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    seq = engine.add_sequence("l", ids, GREEDY)
    while True:
        step = engine.prefill(seq)
        if step.done:
            engine.free(seq)
            return step.logits


@pytest.fixture(scope="module")
def cases(loaded_model):
    return prompts(loaded_model.tokenizer)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_greedy_and_logits_match_transformers(tiny_models, cases, family):
    loaded = load_model(ModelConfig(path=str(tiny_models[family]), device="cpu", dtype="float32"))
    ref = oracle(tiny_models[family])
    chunked = Engine(loaded, EngineConfig(kv_cache_bytes=8 << 20, prefill_chunk_tokens=16))
    whole = Engine(loaded, EngineConfig(kv_cache_bytes=8 << 20, prefill_chunk_tokens=512))
    for ids in cases:
        expected, _ = hf_greedy(ref, ids)
        assert run(chunked, ids) == expected
        assert run(chunked, ids) == expected  # again, its prefix blocks now from the cache
        assert run(whole, ids) == expected
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(last_logits(whole, ids), want, atol=1e-4, rtol=1e-4)
    assert chunked.stats()["used_blocks"] == whole.stats()["used_blocks"] == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_close_to_transformers(tiny_models, cases, family):
    """Until the first divergence, each side's greedy token is within the other's top 5."""
    loaded = load_model(ModelConfig(path=str(tiny_models[family]), device="cpu", dtype="bfloat16"))
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=8 << 20))
    ref = oracle(tiny_models[family], torch.bfloat16)
    agreed = 0
    for ids in cases:
        ours = run(engine, ids)
        theirs, their_logits = hf_greedy(ref, ids)
        for t in range(STEPS):
            our_logits = last_logits(engine, ids + ours[:t])
            assert ours[t] in their_logits[t].topk(5).indices.tolist(), (family, t)
            assert theirs[t] in our_logits.topk(5).indices.tolist(), (family, t)
            if ours[t] != theirs[t]:
                break
            agreed += 1
    # bf16 rounding (both sides; the engine is the nearer to float32) flips near-ties of these
    # tiny models' narrow logits within some steps; a floor that a wrong forward would not reach
    assert agreed >= STEPS // 2


@pytest.mark.parametrize("family", ["mistral", "gemma2", "phi3"])
def test_batched_decode_equals_single(tiny_models, cases, family):
    """Sequences of different lengths (inside and past the window) decode together as alone."""
    engine = Engine(load_model(ModelConfig(path=str(tiny_models[family]), device="cpu", dtype="float32")),
                    EngineConfig(kv_cache_bytes=8 << 20, prefill_chunk_tokens=16))
    base = cases[2]
    batch = [base[:n] for n in (3, 9, 20, 47, 100)] + cases[:2]
    alone = [run(engine, p) for p in batch]
    seqs = [engine.add_sequence("b%d" % i, p, GREEDY) for i, p in enumerate(batch)]
    for s in seqs:
        while not s.prefilled:
            engine.prefill(s)
    while any(not s.finished for s in seqs):
        engine.decode_step([s for s in seqs if not s.finished])
    assert [s.tokens[len(p):] for s, p in zip(seqs, batch)] == alone


def test_prompts_of_a_sliding_window_model_share_one_budget(tiny_models, cases):
    """Computed one by one (no packed forward across windows), the prompts of one call still take
    ``chunk_tokens`` in all, in order: the first what it needs, the next what is left."""
    engine = Engine(load_model(ModelConfig(path=str(tiny_models["mistral"]), device="cpu", dtype="float32")),
                    EngineConfig(kv_cache_bytes=8 << 20, prefill_chunk_tokens=512))
    batch = [cases[2][:10], cases[2][:60], cases[2][:60] + cases[0]]
    seqs = [engine.add_sequence("w%d" % i, p, GREEDY, cache_salt=str(i)) for i, p in enumerate(batch)]
    steps = engine.prefill_many(seqs, None, 40)
    assert [s.num_computed for s in seqs] == [10, 30, 0]
    assert [st.done for st in steps] == [True, False, False]
    while not all(s.prefilled for s in seqs):
        engine.prefill_many([s for s in seqs if not s.prefilled], None, 40)
    while any(not s.finished for s in seqs):
        engine.decode_step([s for s in seqs if not s.finished])
    assert [s.tokens[len(p):] for s, p in zip(seqs, batch)] == [run(engine, p) for p in batch]


def test_family_specs_name_what_differs(tiny_models):
    specs = {f: model_spec(load_model(ModelConfig(path=str(d), device="cpu", dtype="float32")).hf_model)
             for f, d in tiny_models.items()}
    assert [layer.window for layer in specs["gemma2"].layers] == [8, None, 8]
    assert [layer.window for layer in specs["qwen3"].layers] == [None, 8, 8]
    assert [layer.window for layer in specs["mistral"].layers] == [8, 8, 8]
    assert [layer.rope for layer in specs["gemma3"].layers] == ["sliding_attention"] * 2 + ["full_attention"]
    assert specs["gemma2"].attn_softcap == 2.0 and specs["gemma2"].logit_softcap == 2.0
    assert specs["gemma3"].embed_scale == 8.0 and specs["gemma3"].layers[0].q_norm is not None
    assert specs["phi3"].rotary_dim == 8
    assert specs["qwen2"].layers[0].q_norm is None and specs["qwen3"].layers[0].q_norm is not None


@pytest.mark.parametrize("family, change, message", [
    ("gemma3", {"use_bidirectional_attention": True}, "bidirectional"),
    ("mistral", {"hidden_act": "relu"}, "unsupported activation 'relu'"),
    ("gemma2", {"hidden_activation": "swish"}, "unsupported activation 'swish'"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope scaling type 'yarn'"),
])
def test_what_the_forward_cannot_run_is_refused(family, change, message):
    config = tiny_config(family, 1000)
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(ModelLoadError, match=message):
        check_config(config, "tiny")


def test_unknown_architecture_is_refused():
    from transformers import GPT2Config

    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'.*gemma3_text"):
        check_config(GPT2Config(), "somewhere")
