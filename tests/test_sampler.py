"""The batched sampler on synthetic logits: processors, filters, seeds, logprobs."""

from __future__ import annotations

import math

import torch

from mooncake.engine.sampler import Row, process, sample, uniforms
from mooncake.protocol import Sampling

V = 50


def row(tokens=(1, 2, 3), generated: int = 0, seed: int = 7, banned=(), **kw) -> Row:
    return Row(Sampling(**kw), seed, list(tokens), generated, banned)


def logits(b: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed))


def test_uniforms_depend_on_seed_and_position_only():
    a = uniforms(torch.tensor([1, 2, 1]), torch.tensor([5, 5, 6]))
    b = uniforms(torch.tensor([1]), torch.tensor([5]))
    assert a[0] == b[0] and len({a[0].item(), a[1].item(), a[2].item()}) == 3
    u = uniforms(torch.full((4000,), 3), torch.arange(4000))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02


def test_greedy_rows_take_the_argmax_whatever_the_batch():
    x = logits(3)
    out = sample(x, [row(temperature=0), row(temperature=1.0, seed=3), row(temperature=0)])
    assert out.tokens[0] == x[0].argmax().item() and out.tokens[2] == x[2].argmax().item()
    alone = sample(x[1:2], [row(temperature=1.0, seed=3)])
    assert alone.tokens[0] == out.tokens[1]  # a seeded row draws the same in any batch


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    x = probs.clamp_min(1e-30).log().expand(3000, V).clone()
    rows = [Row(Sampling(temperature=1.0), 11, [1], i) for i in range(3000)]
    counts = torch.bincount(torch.tensor(sample(x, rows).tokens), minlength=V).float() / 3000
    assert torch.allclose(counts[:3], probs[:3], atol=0.04) and counts[3:].sum() == 0


def test_filters_top_k_top_p_min_p_leave_the_best_token():
    x = logits(4, seed=1)
    best = x.argmax(-1).tolist()
    rows = [row(temperature=1.0, top_k=1, seed=s) for s in range(2)] + \
           [row(temperature=1.0, top_p=1e-6, seed=5), row(temperature=1.0, min_p=1.0, seed=6)]
    assert sample(x, rows).tokens == best


def test_min_p_drops_unlikely_tokens():
    x = torch.tensor([[math.log(0.6), math.log(0.35), math.log(0.05)] + [-1e9] * (V - 3)]).expand(500, V)
    rows = [Row(Sampling(temperature=1.0, min_p=0.2), 1, [1], i) for i in range(500)]
    assert set(sample(x.clone(), rows).tokens) == {0, 1}


def test_penalties():
    x = torch.zeros(1, V)
    x[0, 4], x[0, 5], x[0, 6] = 2.0, -2.0, 1.0
    r = row(tokens=[6, 4, 4, 5], generated=3, presence_penalty=0.5, frequency_penalty=0.25)
    out = process(x, [r])[0]
    assert out[4] == 2.0 - 0.5 - 0.5 and out[5] == -2.0 - 0.5 - 0.25 and out[6] == 1.0  # 6 is prompt, not output
    rep = process(x, [row(tokens=[6, 4, 4, 5], generated=3, repetition_penalty=2.0)])[0]
    assert rep[4] == 1.0 and rep[5] == -4.0 and rep[6] == 0.5 and rep[7] == 0.0  # prompt tokens count too


def test_logit_bias_and_banned_ids():
    x = logits(2, seed=2)
    out = sample(x, [row(temperature=0, logit_bias={9: 100.0}), row(temperature=0, banned=[int(x[1].argmax())])])
    assert out.tokens[0] == 9 and out.tokens[1] != x[1].argmax().item()


def test_grammar_mask_only_allows_its_tokens():
    x = logits(2, seed=3)
    mask = torch.zeros(2, V, dtype=torch.bool)
    mask[0, 17] = True
    mask[1] = True
    out = sample(x, [row(temperature=1.0, seed=1), row(temperature=0)], mask)
    assert out.tokens == [17, x[1].argmax().item()]


def test_logprobs_are_the_models_and_top_sorted():
    x = logits(2, seed=4)
    out = sample(x, [row(temperature=0, logprobs=3, logit_bias={0: 50.0}), row(temperature=0)])
    lp = x[0].log_softmax(-1)
    first = out.logprobs[0]
    assert out.logprobs[1] is None and out.tokens[0] == 0
    assert math.isclose(first.logprob, lp[0].item(), rel_tol=1e-5)  # before the bias: the model's own
    assert first.top_ids == lp.topk(3).indices.tolist() and first.top_logprobs == sorted(first.top_logprobs)[::-1]


def test_candidate_shortcut_draws_what_a_full_sort_draws(monkeypatch):
    import mooncake.engine.sampler as sampler

    x = torch.randn(16, 4096, generator=torch.Generator().manual_seed(5)) * 6
    rows = [Row(Sampling(temperature=0.9, top_p=0.8, min_p=0.01 * (i % 3), top_k=(0, 20, 200)[i % 3]), i, [1], i)
            for i in range(16)]
    monkeypatch.setattr(sampler, "CANDIDATES", 256)
    k = torch.tensor([r.sampling.top_k or 4096 for r in rows])
    probs = (x / 0.9).softmax(-1)
    assert sampler._candidates(probs, k, torch.full((16,), 0.8), torch.zeros(16))[0].shape[1] == 256  # the shortcut
    short = sample(x, rows).tokens
    monkeypatch.setattr(sampler, "CANDIDATES", 1 << 20)
    assert sample(x, rows).tokens == short
