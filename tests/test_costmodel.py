"""Tests of jddp.perf.costmodel: the pure cost model and the bucket-cap advisor (fast)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jddp._src.tree import MiB
from jddp.buckets import assign_buckets
from jddp.perf import costmodel as cm
from jddp.perf import profiles as rp

NVLINK = cm.Link.gbyte(130, 5)
NET = cm.Link.gbit(100, 10)


def random_profile(rng: np.random.Generator, n: int | None = None) -> cm.ModelProfile:
    n = n or int(rng.integers(1, 40))
    return cm.ModelProfile(
        nbytes=tuple(int(x) for x in rng.integers(4, 8 * MiB, n)),
        backward_s=tuple(float(x) for x in rng.uniform(0, 5e-3, n)),
        forward_s=float(rng.uniform(0, 0.05)),
        optimizer_s=float(rng.uniform(0, 0.01)),
    )


def random_cluster(rng: np.random.Generator) -> cm.ClusterSpec:
    n = int(rng.choice([1, 2, 4, 8, 16, 64, 256]))
    return cm.ClusterSpec(
        n, devices_per_node=8,
        intra=cm.Link(float(rng.uniform(1e9, 3e11)), float(rng.uniform(0, 2e-5))),
        inter=cm.Link(float(rng.uniform(1e9, 5e10)), float(rng.uniform(0, 5e-5))),
        hierarchical=bool(rng.integers(2)),
    )


def test_ring_allreduce_formula():
    link = cm.Link(bandwidth=10e9, latency=7e-6)
    for n in (2, 3, 8, 64):
        b = 123_456_789
        expected = 2 * (n - 1) / n * b / 10e9 + 2 * (n - 1) * 7e-6
        assert cm.ring_allreduce_time(b, n, link) == pytest.approx(expected)
    assert cm.ring_allreduce_time(1000, 1, link) == 0.0
    assert cm.ring_allreduce_time(0, 8, link) == 0.0
    # One node: allreduce_time is the ring over the intra link.
    c = cm.ClusterSpec(8, intra=link)
    assert cm.allreduce_time(1e6, c) == pytest.approx(cm.ring_allreduce_time(1e6, 8, link))


def test_hierarchical_allreduce_formula():
    c = cm.ClusterSpec(32, devices_per_node=8, intra=NVLINK, inter=NET)
    b = 100e6
    expected = (2 * 7 / 8 * b / NVLINK.bandwidth + 14 * NVLINK.latency
                + 2 * 3 / 4 * b / NET.bandwidth + 6 * NET.latency)
    assert cm.allreduce_time(b, c) == pytest.approx(expected)
    flat = cm.ClusterSpec(32, devices_per_node=8, intra=NVLINK, inter=NET, hierarchical=False)
    assert cm.allreduce_time(b, flat) == pytest.approx(
        2 * 31 / 32 * b / NET.bandwidth + 62 * NET.latency)


def test_cluster_validation():
    with pytest.raises(ValueError, match="inter-node"):
        cm.ClusterSpec(16)
    with pytest.raises(ValueError, match="multiple"):
        cm.ClusterSpec(12, inter=NET)
    with pytest.raises(ValueError):
        cm.ClusterSpec(0)


def test_link_units():
    assert cm.Link.gbit(100, 10) == pytest.approx((12.5e9, 1e-5))
    assert cm.Link.gbyte(130, 5) == pytest.approx((130e9, 5e-6))


def test_timeline_order_and_serialisation():
    prof = rp.resnet50_profile(32, 10e12)
    c = cm.ClusterSpec(32, intra=NVLINK, inter=NET)
    est = cm.simulate_iteration(prof, c, cap_mb=5)
    ready = prof.ready_times()
    prev_end = 0.0
    for i, b in enumerate(est.buckets):
        assert b.index == i
        assert b.ready_s == pytest.approx(max(ready[j] for j in b.leaves))
        assert b.start_s >= b.ready_s - 1e-15
        assert b.start_s >= prev_end - 1e-15
        assert b.end_s - b.start_s == pytest.approx(cm.allreduce_time(b.nbytes, c))
        prev_end = b.end_s
    # Buckets are exactly jddp's planner's buckets, in order, and cover every leaf once.
    groups = assign_buckets(prof.nbytes, prof.dtypes, 5 * MiB, 1 * MiB)
    assert [list(b.leaves) for b in est.buckets] == groups
    assert sorted(j for b in est.buckets for j in b.leaves) == list(range(prof.num_leaves))
    assert est.iteration_s == pytest.approx(
        max(prev_end, prof.forward_s + prof.backward_total_s) + prof.optimizer_s)


def test_no_overlap_is_compute_plus_comm():
    rng = np.random.default_rng(0)
    prof = random_profile(rng, 20)
    c = cm.ClusterSpec(8, intra=NVLINK)
    off = cm.simulate_iteration(prof, c, cap_mb=2, overlap=False)
    assert off.iteration_s == pytest.approx(prof.compute_s + off.comm_s)
    assert off.overlap_fraction == pytest.approx(0.0, abs=1e-12)
    cpu = cm.ClusterSpec(8, intra=NVLINK, async_collectives=False)
    assert cm.simulate_iteration(prof, cpu, cap_mb=2).iteration_s == pytest.approx(
        off.iteration_s)


@pytest.mark.parametrize("seed", range(30))
def test_random_properties(seed):
    rng = np.random.default_rng(seed)
    prof = random_profile(rng)
    c = random_cluster(rng)
    cap = float(rng.choice([0.25, 1, 4, 25, 100, math.inf]))
    first = min(cap, float(rng.choice([0.1, 1.0])))
    on, off, gain = cm.overlap_speedup(prof, c, cap_mb=cap, first_mb=first)
    eps = 1e-12
    # Never faster than compute; overlap never slower than no overlap.
    assert on.iteration_s >= prof.compute_s - eps
    assert off.iteration_s >= on.iteration_s - eps
    assert gain >= -eps
    assert 0.0 - eps <= on.overlap_fraction <= 1.0 + eps
    assert on.comm_s == pytest.approx(off.comm_s)
    # Every leaf is in exactly one bucket.
    assert sorted(j for b in on.buckets for j in b.leaves) == list(range(prof.num_leaves))
    # More bandwidth or less latency never makes it slower.
    faster = cm.ClusterSpec(
        c.num_devices, devices_per_node=c.devices_per_node,
        intra=cm.Link(c.intra.bandwidth * 2, c.intra.latency / 2),
        inter=cm.Link(c.inter.bandwidth * 2, c.inter.latency / 2),
        hierarchical=c.hierarchical)
    for ov in (True, False):
        a = cm.simulate_iteration(prof, c, cap_mb=cap, first_mb=first, overlap=ov)
        b = cm.simulate_iteration(prof, faster, cap_mb=cap, first_mb=first,
                                  overlap=ov)
        assert b.iteration_s <= a.iteration_s + eps
    # All-reduce time is monotone in bytes.
    sizes = np.sort(rng.integers(0, 1 << 30, 5))
    times = [cm.allreduce_time(int(s), c) for s in sizes]
    assert all(t1 <= t2 + eps for t1, t2 in zip(times, times[1:], strict=False))


@pytest.mark.parametrize("seed", range(10))
def test_suggest_bucket_cap_minimises_prediction(seed):
    rng = np.random.default_rng(100 + seed)
    prof = random_profile(rng, 30)
    c = random_cluster(rng)
    cands = (0.5, 1.0, 2.0, 8.0, 32.0, math.inf)
    cap = cm.suggest_bucket_cap(prof, c, candidates_mb=cands)
    assert cap in cands
    adv = cm.advise_bucket_cap(prof, c, candidates_mb=cands)
    times = {k: e.iteration_s for k, e in adv.predictions}
    assert times[cap] == min(times.values())
    assert cap == min(k for k, t in times.items() if t == min(times.values()))
    assert "suggested" in adv.table()


def test_suggest_bucket_cap_inputs():
    c = cm.ClusterSpec(64, inter=NET)
    params = {"a": jnp.zeros((1024, 1024)), "b": jnp.zeros((1024,)), "c": jnp.zeros((512, 512))}
    sizes = [4 * 1024 * 1024, 4096, 512 * 512 * 4]
    with pytest.raises(ValueError, match="backward_s"):
        cm.suggest_bucket_cap(params, c)
    a = cm.suggest_bucket_cap(params, c, backward_s=0.01)
    b = cm.suggest_bucket_cap(sizes, c, backward_s=0.01)
    assert a in cm.DEFAULT_CAP_CANDIDATES_MB and b in cm.DEFAULT_CAP_CANDIDATES_MB


def test_zero_compute_prefers_one_bucket():
    # With nothing to overlap, fewer all-reduces (less latency) can only help.
    prof = cm.ModelProfile(nbytes=(MiB,) * 50, backward_s=(0.0,) * 50)
    c = cm.ClusterSpec(256, inter=NET)
    assert cm.suggest_bucket_cap(prof, c, candidates_mb=(1, 10, math.inf),
                                   first_mb=1000) == math.inf


def test_allreduce_table_interpolation():
    c = cm.ClusterSpec(8, allreduce_table=((1000, 1e-3), (2000, 3e-3)))
    assert cm.allreduce_time(1500, c) == pytest.approx(2e-3)
    assert cm.allreduce_time(3000, c) == pytest.approx(5e-3)  # extrapolated
    assert c.with_devices(16 // 2).allreduce_table  # same N keeps the table
    with pytest.raises(ValueError):
        cm.ClusterSpec(8, allreduce_table=((1000, 1e-3),))


# ----------------------------------------------------------------------------- past one host


def _two_level(nodes=4, inter_gbit=25.0):
    return cm.ClusterSpec(nodes * 8, devices_per_node=8, intra=cm.Link.gbyte(200, 5),
                          inter=cm.Link.gbit(inter_gbit, 20))


def test_across_bytes_per_step_by_strategy():
    cluster = _two_level(nodes=4)  # N = 32, m = 4
    s = 100 * 2**20
    assert cm.across_bytes_per_step(s, cluster, "flat") == pytest.approx(2 * 31 / 32 * s)
    assert cm.across_bytes_per_step(s, cluster, "hierarchical") == pytest.approx(2 * 3 / 4 * s)
    assert cm.across_bytes_per_step(s, cluster, "local_sgd", 16) == pytest.approx(1.5 * s / 16)
    one_node = cm.ClusterSpec(8, devices_per_node=8)
    assert cm.across_bytes_per_step(s, one_node, "flat") == 0.0
    with pytest.raises(ValueError, match="strategy must be one of"):
        cm.across_bytes_per_step(s, cluster, "gossip")


def test_simulate_strategy_orders_the_strategies_on_a_slow_link():
    profile = cm.ModelProfile.from_sizes([8 * 2**20] * 12, backward_s=0.05, forward_s=0.025)
    cluster = _two_level(nodes=16, inter_gbit=10.0)
    est = {name: cm.simulate_strategy(profile, cluster, name, period=16)
           for name in cm.STRATEGIES}
    assert est["hierarchical"].step_s < est["flat"].step_s  # fewer slow-link latencies
    assert est["hybrid"].step_s == est["hierarchical"].step_s
    # Stage 1 reduces the gradients over every device: flat's bytes and time, not 1/L.
    assert est["hybrid_stage1"].step_s == est["flat"].step_s
    assert est["hybrid_stage1"].across_bytes == est["flat"].across_bytes
    assert est["hybrid"].across_bytes < est["flat"].across_bytes
    assert est["local_sgd"].step_s < est["hierarchical"].step_s
    assert est["diloco"].step_s >= est["local_sgd"].step_s
    lsgd = est["local_sgd"]
    # A local step reduces inside the node only; the averaging step adds one parameter average.
    assert lsgd.local_step_s < lsgd.sync_step_s
    avg = cm.averaging_time(profile.total_bytes, cluster)
    assert lsgd.sync_step_s == pytest.approx(lsgd.local_step_s + avg)
    assert lsgd.step_s == pytest.approx(lsgd.local_step_s + avg / 16)
    assert 0 < lsgd.efficiency <= 1
    # Averaging every step costs more than the hierarchical gradient reduction it replaces
    # (it cannot overlap the backward).
    assert cm.simulate_strategy(profile, cluster, "local_sgd", period=1).step_s > (
        est["hierarchical"].step_s)


def _example_lm_params(dtype=jnp.float32):
    """The parameter shapes of examples/train_lm.py's default TransformerLM (width 96, 2 blocks,
    byte vocabulary, sequence 64, tied output), without initialising it."""
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            y = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=96,
                                                deterministic=True)(nn.LayerNorm()(x), mask=mask)
            x = x + y
            return x + nn.Dense(96)(nn.gelu(nn.Dense(4 * 96)(nn.LayerNorm()(x))))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(256, 96)
            x = embed(tokens) + self.param("pos", nn.initializers.normal(0.02), (64, 96))
            for _ in range(2):
                x = Block()(x, nn.make_causal_mask(tokens))
            return embed.attend(nn.LayerNorm()(x))

    shapes = jax.eval_shape(lambda: LM().init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32)))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes["params"])


def test_advisor_identical_predictions_on_the_example_lm_are_explained():
    """Issue 35: the advisor predicted identical numbers for every bucket cap on the LM. Why: its
    gradients (0.97 MiB in float32) fit in DDP's 1 MiB first bucket, so every cap from 1 MiB up
    makes the same single bucket, and a prediction is a function of the buckets. The advice now
    says so (``same_buckets``, ``note``, the table); caps that cut differently still differ."""
    params = _example_lm_params()
    total = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(params))
    assert 0.9 * MiB < total < MiB
    cluster = cm.ClusterSpec(8)
    adv = cm.advise_bucket_cap(params, cluster, backward_s=0.01)
    preds = dict(adv.predictions)
    big = [c for c in preds if c >= 1.0]
    assert {preds[c].iteration_s for c in big} == {preds[1.0].iteration_s}
    assert all(preds[c].num_buckets == 1 for c in big)
    assert preds[0.25].num_buckets == 4 and preds[0.25].iteration_s != preds[1.0].iteration_s
    assert adv.same_buckets() == {c: (1.0 if c >= 1.0 else c) for c in preds}
    assert "like a smaller candidate" in adv.note and "(= 1: same buckets)" in adv.table()
    # bf16 parameters (0.49 MiB) and the "model" candidates: not one cap changes the plan.
    half = cm.advise_bucket_cap(_example_lm_params(jnp.bfloat16), cluster, backward_s=0.01,
                                candidates_mb=(0.5, 1, 2, 4, 8, 16, 25, 50, 100))
    assert len({est.iteration_s for _, est in half.predictions}) == 1
    assert half.note.startswith("Every candidate cap cuts the 0.486 MiB of gradients into the "
                                "same 1 bucket(s)") and "does not matter" in half.note
    # A model larger than the caps: every candidate cuts differently, no note.
    spread = cm.advise_bucket_cap([MiB] * 64, cluster, backward_s=0.05,
                                  candidates_mb=(0.5, 2, 8, 32, 128))
    assert spread.note == "" and "same buckets" not in spread.table()

