"""The engine's own one-token attention kernel (``native.py``) against torch's attention in
float32 on the same bfloat16 inputs, on the decoder workspace's layout; and the switch that
keeps the engine on torch's kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mooncake.config import EngineConfig, ModelConfig
from mooncake.engine import Engine, load_model
from mooncake.engine.native import load_attention

ATTEND = load_attention()
needs_kernel = pytest.mark.skipif(ATTEND is None, reason="no C compiler or no AVX-512 VNNI here")


@needs_kernel
@pytest.mark.parametrize("hkv,groups,keys,dim", [(3, 3, 1, 64), (3, 3, 513, 64), (2, 1, 40, 128), (1, 4, 7, 16)])
def test_attention_kernel_matches_float32_attention_over_a_workspace_slice(hkv, groups, keys, dim):
    gen = torch.Generator().manual_seed(keys)
    ws = torch.randn(2, hkv, keys + 50, dim, generator=gen).bfloat16() * 3  # [K/V, Hkv, capacity, D]
    k, v = ws[0, :, :keys], ws[1, :, :keys]  # heads a capacity apart, as the decoder's rows
    q = torch.randn(hkv * groups, dim, generator=gen).bfloat16()
    assert ATTEND.serves(k, torch.bfloat16)
    got = ATTEND(q, k, v, dim ** -0.5)
    want = F.scaled_dot_product_attention(q.float().view(hkv, groups, dim), k.float(), v.float())
    assert got.dtype == torch.bfloat16 and got.shape == (hkv * groups, dim)
    torch.testing.assert_close(got.float(), want.reshape(hkv * groups, dim), rtol=1.6e-2, atol=1e-2)


@needs_kernel
def test_attention_kernel_serves_only_bfloat16_rows_of_contiguous_keys():
    ws = torch.zeros(3, 20, 64, dtype=torch.bfloat16)
    assert not ATTEND.serves(ws.float(), torch.float32)
    assert not ATTEND.serves(ws.transpose(1, 2), torch.bfloat16)
    assert not ATTEND.serves(torch.zeros(3, 20, 40, dtype=torch.bfloat16), torch.bfloat16)  # D not a multiple of 16


def test_native_kernels_off_keeps_torchs_kernels():
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", quantization="int8"))
    engine = Engine(loaded, EngineConfig(kv_cache_bytes=8 << 20, native_kernels=False, profile_at_start=False))
    assert engine.model.attend_one is None
    assert all(layer.down.kernel is None for layer in engine.model.spec.layers)
