"""Random operation sequences against the tiered store: accounting and contents always exact."""

from __future__ import annotations

import tempfile

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mooncake.tiers.memory import DeviceTier, DramTier
from mooncake.tiers.lmdb_tier import LmdbTier
from mooncake.tiers.tiered import TieredStore


KEYS = st.integers(0, 11)
TENANTS = st.sampled_from([None, "", "a", "b"])  # None: no session
OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), KEYS, st.sampled_from([64, 128, 256, 640]), TENANTS),
    st.tuples(st.just("keep"), st.lists(KEYS, min_size=1, max_size=4), TENANTS),
    st.tuples(st.just("get"), st.lists(KEYS, min_size=1, max_size=4), st.booleans()),
    st.tuples(st.just("remove"), st.lists(KEYS, max_size=3)),
), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, gate=st.booleans(), promote=st.booleans())
def test_random_operations_keep_invariants(ops, gate, promote):
    with tempfile.TemporaryDirectory() as d:
        tiers = [DeviceTier(1024, "cpu"), DramTier(2048), LmdbTier(d, 3072)]
        store = TieredStore(tiers, promote_on_hit=promote,
                            ssd_admission="after_hits" if gate else "on_demotion", session_blocks_per_key=2)
        truth: dict[bytes, torch.Tensor] = {}
        version = 0
        for op in ops:
            if op[0] == "put":
                _, k, nbytes, tenant = op
                version += 1
                t = torch.full((nbytes // 4,), float(version))
                if store.put_many([bytes([k]) * 32], [t], keep_s=0 if tenant is None else 600, tenant=tenant or "") == 1:
                    truth[bytes([k]) * 32] = t
            elif op[0] == "keep":
                _, ks, tenant = op
                store.keep([bytes([k]) * 32 for k in ks], 0 if tenant is None else 600, tenant or "")
            elif op[0] == "get":
                _, ks, prefix = op
                want = [bytes([k]) * 32 for k in ks]
                got = store.get_many(want, prefix=prefix)
                got_keys = [k for k, _ in got]
                rest = iter(want)
                assert all(k in rest for k in got_keys)  # a subsequence of the request, in its order
                if prefix:
                    assert got_keys == want[:len(got_keys)]
                for k, b in got:
                    assert torch.equal(b.tensor, truth[k])  # never stale or wrong bytes
            else:
                store.remove([bytes([k]) * 32 for k in op[1]])
            store.check_invariants()  # each kept block of one tenant, none past its quota
            for k in truth:
                if store.tier_of(k) == "lmdb" and gate:
                    assert store.stats.block_hits.get(k, 0) >= 1
        for k, tier in store.stored():
            assert tier in ("device", "dram", "lmdb")
            assert torch.equal(store.get_many([k], count=False)[0][1].tensor, truth[k])
        store.close()
