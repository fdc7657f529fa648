"""Buckets(cap_mb="auto"): a timed choice among distinct plans, fixed once, not changing training."""

import jax
import numpy as np
import optax
import pytest
from _models import max_abs_diff, mlp_loss, mlp_params, regression_batch

import jddp
from jddp._src.plan import autocap
from jddp.buckets import AutoCap, CapChoice

SIZES = [32, 48, 48, 48, 16]  # 4 layers, 6-9 KiB each: caps of a few KiB give different plans
KIB = 1 / 1024


def _planned(cap_mb: float, sizes=SIZES):
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(cap_mb=cap_mb, first_mb=min(cap_mb, 1.0)))
    return ddp.plan(mlp_params(0, sizes), regression_batch(0, 16, sizes[0], sizes[-1]))


def test_auto_trains_like_a_fixed_cap_and_reports_its_choice():
    params = mlp_params(0, SIZES)
    batches = [regression_batch(s, 16, SIZES[0], SIZES[-1]) for s in range(3)]
    policy = AutoCap(candidates_mb=(4 * KIB, 16 * KIB, 25.0), rounds=2)
    auto = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(cap_mb=policy))
    fixed = jddp.DataParallel(mlp_loss, optax.adam(1e-2))
    assert auto.cap_choice is None
    with pytest.raises(ValueError, match="has not chosen a cap yet.*ddp.step.tune"):
        auto.plan(params, batches[0])
    with pytest.raises(ValueError, match="has not chosen a cap yet"):
        auto.step.lower(auto.init(params), batches[0])
    sa, sf = auto.init(params), fixed.init(params)
    for b in batches:
        sa, ma = auto.step(sa, b)
        sf, mf = fixed.step(sf, b)
        np.testing.assert_allclose(float(ma["loss"]), float(mf["loss"]), rtol=1e-6)
    # The timing steps ran on copies: the state advanced by the three real steps only.
    assert int(sa.step) == 3
    assert max_abs_diff(sa.params, sf.params) < 1e-6
    choice = auto.cap_choice
    assert isinstance(choice, CapChoice)
    assert choice.cap_mb in choice.candidates_mb and choice.default_mb == 25.0
    assert len(choice.median_s) == len(choice.candidates_mb) == 3
    assert all(t > 0 for t in choice.median_s)
    # Each candidate against the default, round by round: ratio and spread; the default's own
    # ratio is 1 with no spread.
    assert choice.rounds == 2 and len(choice.ratio) == len(choice.spread) == 3
    d = choice.candidates_mb.index(25.0)
    assert choice.ratio[d] == 1.0 and choice.spread[d] == 0.0 and choice.note == ""
    if choice.cap_mb != 25.0:
        k = choice.candidates_mb.index(choice.cap_mb)
        assert 1 - choice.ratio[k] > max(policy.margin, choice.spread[k])
    # Fixed once chosen: the configuration, the plan and the compiled programs agree with it.
    cap = int(choice.cap_mb * 2**20)
    assert auto.config.reduce.cap_bytes == cap
    assert auto.bucket_plan.cap_bytes == cap
    assert "Buckets(cap_mb='auto')" in str(auto.bucket_plan)
    assert f"reduce=jddp.Buckets(cap_mb={choice.cap_mb:g})" in str(choice)
    assert auto.step.cache_size() == 1
    # Pinning the reported number gives the same plan.
    assert _planned(choice.cap_mb).buckets == auto.bucket_plan.buckets
    assert auto.step.tune(sa, batches[0]) is choice


def test_candidates_are_distinct_plans_and_keep_the_default():
    plan = _planned(25.0)
    caps = (1 * KIB, 2 * KIB, 4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 1.0, 50.0)
    found = autocap.distinct_candidates(plan, caps, plan.first_bytes, 25.0)
    kept = [c for c, _ in found]
    assert 25.0 in kept and 1.0 not in kept and 50.0 not in kept  # one bucket: same as 25 MiB
    plans = [_planned(c).buckets for c in kept]
    assert len({tuple(tuple(b.indices) for b in p) for p in plans}) == len(kept)
    assert [n for _, n in found] == [len(p) for p in plans]
    # Plans that differ only by where a bias goes (256 B of 57 KiB) are timed once.
    sizes = [32, 64, 64, 64, 64]
    plan = _planned(25.0, sizes)
    a, b = 16.75 * KIB, 32.75 * KIB  # 2 buckets each, 256 B apart
    assert _planned(a, sizes).buckets != _planned(b, sizes).buckets
    assert _planned(a, sizes).num_buckets == _planned(b, sizes).num_buckets
    exact = autocap.distinct_candidates(plan, (a, b), plan.first_bytes, 25.0, tolerance=0.0)
    assert [c for c, _ in exact] == [a, b, 25.0]
    merged = autocap.distinct_candidates(plan, (a, b), plan.first_bytes, 25.0)
    assert [c for c, _ in merged] == [a, 25.0]


def test_single_plan_is_not_timed():
    params = mlp_params(0, SIZES)
    batch = regression_batch(0, 16, SIZES[0], SIZES[-1])
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                            reduce=jddp.Buckets(cap_mb=AutoCap(candidates_mb=(50.0,))))
    state, _ = ddp.step(ddp.init(params), batch)
    assert ddp.cap_choice.candidates_mb == (25.0,)  # 50 MiB: the same single bucket
    assert np.isnan(ddp.cap_choice.median_s[0]) and ddp.config.reduce.cap_bytes == 25 * 2**20
    note = str(ddp.bucket_plan)  # not "from 1 timed caps": nothing was timed
    assert "without timing: every candidate cap gives this one plan" in note
    assert "timed caps" not in note
    assert int(state.step) == 1 and ddp.step.cache_size() == 1


def test_pick_keeps_a_cap_only_above_the_noise_of_its_own_rounds():
    caps = (1.0, 8.0, 25.0)
    default = [1.0, 1.2, 0.9, 1.1, 1.0]  # the machine drifts by 30% over the rounds

    def rounds(*ratios):
        return [d * r for d, r in zip(default, ratios, strict=True)]

    steady = rounds(0.9, 0.9, 0.9, 0.9, 0.9)  # 10% faster in every round
    noisy = rounds(0.6, 1.1, 0.7, 1.2, 0.8)  # 20% faster in the median, spread 0.6
    v = autocap.pick(caps, [noisy, steady, default], 25.0, 0.03)
    assert v.cap_mb == 8.0  # the steady gain, not the larger noisy one
    assert v.ratio[0] == pytest.approx(0.8) and v.spread[0] == pytest.approx(0.6)
    assert v.ratio[1] == pytest.approx(0.9) and v.spread[1] == pytest.approx(0.0, abs=1e-12)
    assert v.ratio[2] == 1.0 and v.spread[2] == 0.0
    # Below the margin, or within the spread: the default stays.
    assert autocap.pick(caps, [rounds(*[0.99] * 5), noisy, default], 25.0, 0.03).cap_mb == 25.0
    slight = rounds(0.92, 0.98, 0.95, 0.94, 0.96)  # 5% faster, spread 6%
    assert autocap.pick(caps, [slight, default, default], 25.0, 0.03).cap_mb == 25.0
    # One round measures no spread: nothing is kept.
    one = autocap.pick(caps, [[0.5], [0.5], [1.0]], 25.0, 0.03)
    assert one.cap_mb == 25.0 and np.isnan(one.ratio).all()


def test_tuning_time_is_bounded_and_says_nothing_was_timed():
    params = mlp_params(0, SIZES)
    batch = regression_batch(0, 16, SIZES[0], SIZES[-1])
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(cap_mb=AutoCap(
        candidates_mb=(1 * KIB, 25.0), max_tune_s=0.0)))
    state, _ = ddp.step(ddp.init(params), batch)
    choice = ddp.cap_choice
    assert len(choice.candidates_mb) == 2 and choice.cap_mb == 25.0 and choice.rounds == 0
    assert "time bound" in choice.note and "no spread" in choice.note
    assert "time bound" in str(choice) and np.isnan(choice.median_s).all()
    assert int(state.step) == 1 and ddp.step.cache_size() == 1


def test_bad_auto_options():
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="number of MiB, 'auto'"):
        jddp.DataParallel(mlp_loss, opt, reduce=jddp.Buckets(cap_mb="fast"))
    plan = _planned(25.0)
    with pytest.raises(ValueError, match="pass only one"):
        jddp.DataParallel(mlp_loss, opt, reduce=jddp.Buckets(cap_mb="auto", plan=plan))
    with pytest.raises(ValueError, match="rounds"):
        AutoCap(rounds=0)
    with pytest.raises(ValueError, match="candidates_mb"):
        AutoCap(candidates_mb=(1.0, -2.0))
    with pytest.raises(ValueError, match="margin"):
        AutoCap(margin=1.5)
    with pytest.raises(ValueError, match="max_tune_s"):
        AutoCap(max_tune_s=-1.0)
    assert jax.tree.leaves(AutoCap().candidates_mb)  # the defaults validate


@pytest.mark.parametrize("opts", [{"loss": jddp.Loss(rng=True)}, {"place": jddp.ZeRO(stage=3)}])
def test_auto_combines_with_per_example_keys_and_sharded_stages(opts):
    """The timed candidates take the step's other inputs (the run's key) and state layouts (a
    sharded stage's pieces); training equals the fixed 25 MB step to 1e-6."""
    rng = "loss" in opts

    def loss(p, b, *key):
        drop = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, (SIZES[0],)))(key[0]) if rng else 1
        return mlp_loss(p, {"x": b["x"] * drop, "y": b["y"]})

    params, key = mlp_params(0, SIZES), jax.random.key(3)
    policy = AutoCap(candidates_mb=(4 * KIB, 25.0), rounds=1)
    states, losses = [], []
    for cap in (policy, 25.0):
        ddp = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(cap_mb=cap), **opts)
        state = ddp.init(params)
        for s in range(2):
            kw = {"rng": key} if rng else {}
            state, m = ddp.step(state, regression_batch(s, 16, SIZES[0], SIZES[-1]), **kw)
            losses.append(float(m["loss"]))
        states.append(jax.tree.map(np.asarray, state.params))
    assert max_abs_diff(states[0], states[1]) < 1e-6
    np.testing.assert_allclose(losses[:2], losses[2:], rtol=1e-6)
