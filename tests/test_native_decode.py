"""The decode step's own kernels (``native_decode.py``) against torch references: attention
with rotary and KV write (ragged lengths, GQA, sliding window), RMSNorm with the residual add,
and a row computing bitwise the same numbers alone as in a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mooncake.engine.kernels.native_decode import load_decode_kernels
from mooncake.engine.model.rope import RopeParams, tables_of

KERNELS = load_decode_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler or no AVX-512 here")
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def case(dtype: torch.dtype, B: int, H: int, Hkv: int, D: int, kcap: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(dtype)
    kv = torch.randn(2, B + 1, Hkv, kcap, D, generator=g).to(dtype)  # one spare row: rows >= B untouched
    cos, sin = tables_of(RopeParams("default", 10000.0, {}), D, kcap, dtype, torch.device("cpu"))
    return qkv, kv, cos, sin


def reference(qkv, kv, cos, sin, pos, H, window, scale):
    """Float32 rotary, KV write (rounded to the dtype) and softmax attention, row by row."""
    B, Hkv, D = qkv.shape[0], kv.shape[2], kv.shape[4]
    kv = kv.clone()
    x = qkv.float().view(B, H + 2 * Hkv, D)
    out = []
    for b in range(B):
        p = int(pos[b])
        c, s = cos[p].float(), sin[p].float()
        q = rotate(x[b, :H], c, s).to(qkv.dtype).float()
        kv[0, b, :, p] = rotate(x[b, H:H + Hkv], c, s).to(qkv.dtype)
        kv[1, b, :, p] = x[b, H + Hkv:].to(qkv.dtype)
        lo = max(0, p - window + 1) if window else 0
        k, v = kv[0, b, :, lo:p + 1].float(), kv[1, b, :, lo:p + 1].float()
        o = F.scaled_dot_product_attention(q.view(Hkv, H // Hkv, D), k, v, scale=scale)
        out.append(o.reshape(H * D))
    return torch.stack(out), kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D,window", [(9, 3, 64, None), (4, 4, 32, None), (8, 2, 128, 7), (6, 1, 96, None)])
def test_attention_matches_torch_with_ragged_lengths(dtype, H, Hkv, D, window):
    pos = torch.tensor([0, 5, 37, 16, 130], dtype=torch.int64)
    qkv, kv, cos, sin = case(dtype, len(pos), H, Hkv, D, 160)
    want, want_kv = reference(qkv, kv, cos, sin, pos, H, window, D ** -0.5)
    got = KERNELS.attention(qkv, cos, sin, kv, pos, H, window, D ** -0.5)
    assert got.dtype == dtype and got.shape == (len(pos), H * D)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    torch.testing.assert_close(kv.float(), want_kv.float(), **TOL[dtype])  # new k/v written, the rest untouched
    assert torch.equal(kv[:, len(pos)], want_kv[:, len(pos)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_row_is_bitwise_the_same_alone_and_in_a_batch(dtype):
    H, Hkv, D = 9, 3, 64
    pos = torch.tensor([511, 3, 200, 64, 1000, 17, 700, 90], dtype=torch.int64)
    qkv, kv, cos, sin = case(dtype, len(pos), H, Hkv, D, 1024, seed=1)
    batch_kv = kv.clone()
    batched = KERNELS.attention(qkv, cos, sin, batch_kv, pos, H, None, 0.125)
    for r in range(len(pos)):
        alone_kv = kv[:, r:r + 1].clone()
        alone = KERNELS.attention(qkv[r:r + 1], cos, sin, alone_kv, pos[r:r + 1].clone(), H, None, 0.125)
        assert torch.equal(alone[0], batched[r])
        assert torch.equal(alone_kv[:, 0], batch_kv[:, r])


def test_attention_takes_a_strided_workspace_view():
    """The engine passes ``ws[li]``, a layer of a workspace with more rows than the batch."""
    H, Hkv, D = 9, 3, 64
    pos = torch.tensor([10, 20], dtype=torch.int64)
    qkv, kv, cos, sin = case(torch.float32, 2, H, Hkv, D, 64)
    ws = torch.zeros(3, 2, 4, Hkv, 64, D)
    ws[1, :, :3] = kv
    got = KERNELS.attention(qkv, cos, sin, ws[1], pos, H, None, 0.125)
    want, want_kv = reference(qkv, kv, cos, sin, pos, H, None, 0.125)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(ws[1, :, :3], want_kv, **TOL[torch.float32])
    assert not ws[0].any() and not ws[2].any() and not ws[1, :, 3].any()


def test_attention_rejects_bad_calls():
    qkv, kv, cos, sin = case(torch.float32, 2, 9, 3, 64, 32)
    with pytest.raises(ValueError, match="positions"):
        KERNELS.attention(qkv, cos, sin, kv, torch.tensor([3, 32]), 9, None, 0.125)
    with pytest.raises(ValueError, match="cannot take"):
        KERNELS.attention(qkv.bfloat16(), cos, sin, kv, torch.tensor([3, 4]), 9, None, 0.125)
    with pytest.raises(ValueError, match="cannot take"):
        KERNELS.attention(qkv, cos, sin, kv, torch.tensor([3, 4]), 8, None, 0.125)  # 8 heads: qkv too wide
    with pytest.raises(ValueError, match="cannot take"):
        KERNELS.attention(qkv, cos, sin, kv, torch.tensor([3, 4], dtype=torch.int32), 9, None, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", [True, False])
def test_add_rmsnorm_matches_torch(dtype, add):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 576, generator=g) * 3).to(dtype)
    a = torch.randn(5, 576, generator=g).to(dtype) if add else None
    w = torch.rand(576, generator=g).to(dtype)
    want_x = x + a if add else x.clone()  # rounded to the dtype, as the in-place add
    want = (want_x.float() * torch.rsqrt(want_x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
    h = KERNELS.add_rmsnorm(x, a, w, 1e-5)
    assert torch.equal(x, want_x)
    torch.testing.assert_close(h, want, **TOL[dtype])
    torch.testing.assert_close(h.float(), F.rms_norm(want_x.float(), (576,), w.float(), 1e-5), **TOL[dtype])


def test_add_rmsnorm_row_is_bitwise_the_same_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(3)
    x, a = torch.randn(32, 576, generator=g).bfloat16(), torch.randn(32, 576, generator=g).bfloat16()
    w = torch.rand(576, generator=g).bfloat16()
    xb = x.clone()
    hb = KERNELS.add_rmsnorm(xb, a, w, 1e-5)
    for r in (0, 7, 31):
        xr = x[r:r + 1].clone()
        assert torch.equal(KERNELS.add_rmsnorm(xr, a[r:r + 1].clone(), w, 1e-5)[0], hb[r])
        assert torch.equal(xr[0], xb[r])


def test_add_rmsnorm_rejects_bad_calls():
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="cannot take"):
        KERNELS.add_rmsnorm(x, None, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="cannot take"):
        KERNELS.add_rmsnorm(x, torch.randn(2, 64).bfloat16(), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="cannot take"):
        KERNELS.add_rmsnorm(torch.randn(2, 63), None, torch.ones(63), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_writes_the_new_kv_into_the_pool_too(dtype):
    H, Hkv, D, T = 9, 3, 64, 16
    pos = torch.tensor([7, 40, 16], dtype=torch.int64)
    qkv, kv, cos, sin = case(dtype, 3, H, Hkv, D, 64)
    pool = torch.zeros(6, 2, 2, Hkv, T, D, dtype=dtype)  # [blocks, L, 2, Hkv, T, D]
    blocks, offsets = torch.tensor([4, 1, 2]), pos % T
    KERNELS.attention(qkv, cos, sin, kv, pos, H, None, 0.125, (pool[:, 1], blocks, offsets))
    for b in range(3):
        assert torch.equal(pool[blocks[b], 1, :, :, offsets[b]], kv[:, b, :, pos[b]])
    written = torch.zeros(6, 2, Hkv, T, D, dtype=torch.bool)
    for b in range(3):
        written[blocks[b], :, :, offsets[b]] = True
    assert not pool[:, 1][~written].any()  # nothing else written
    assert not pool[:, 0].any()
    with pytest.raises(ValueError, match="out of range"):
        KERNELS.attention(qkv, cos, sin, kv, pos, H, None, 0.125, (pool[:, 1], torch.tensor([4, 1, 6]), offsets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(3, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = gu.split(1536, -1)
    torch.testing.assert_close(KERNELS.silu_mul(gu), F.silu(gate).mul_(up), **TOL[dtype])
    assert torch.equal(KERNELS.silu_mul(gu[1:2].clone())[0], KERNELS.silu_mul(gu)[1])
    with pytest.raises(ValueError, match="cannot take"):
        KERNELS.silu_mul(gu[:, :100].contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_sharing_a_workspace_row_match_one_token_steps_bitwise(dtype):
    """A speculative verify: a sequence's tokens at consecutive positions, each on its sequence's
    workspace row (``ws_rows``), beside another sequence's one token, give bitwise what one-token
    steps give one after another: every key stored before any row attends, each up to its own position."""
    H, Hkv, D = 9, 3, 64
    qkv, kv, cos, sin = case(dtype, 5, H, Hkv, D, 64, seed=3)
    pos = torch.tensor([20, 21, 22, 40, 23], dtype=torch.int64)
    rows = torch.tensor([0, 0, 0, 1, 0], dtype=torch.int64)
    steps, want = kv.clone(), []
    for b in range(5):
        r = int(rows[b])
        one = steps[:, r:r + 1]  # a view: the step writes its key into the row
        want.append(KERNELS.attention(qkv[b:b + 1], cos, sin, one, pos[b:b + 1], H, None, D ** -0.5))
    got = KERNELS.attention(qkv, cos, sin, kv, pos, H, None, D ** -0.5, ws_rows=rows)
    assert torch.equal(got, torch.cat(want)) and torch.equal(kv, steps)
    with pytest.raises(ValueError, match="workspace rows"):
        KERNELS.attention(qkv, cos, sin, kv, pos, H, None, D ** -0.5, ws_rows=torch.tensor([0, 0, 0, 9, 0]))
