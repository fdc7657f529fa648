"""Buckets(cap_mb="model") and the default plan: the cost model picks the plan from the traced
gradient sizes, no timing."""

import dataclasses
import math

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import max_abs_diff

import jddp
from jddp._src.introspect import hlo
from jddp._src.plan import modelcap
from jddp.buckets import CapChoice, ModelCap, assign_buckets, make_plan
from jddp.perf.costmodel import ClusterSpec
from tests import _reference as ref
from tests.launch_util import run_launcher

MiB = 2**20
DEFAULT = (25.0, 1.0)


def _plan(sizes, dtypes=None):
    """A plan over leaves of ``sizes`` bytes (float32 unless ``dtypes``), used in list order."""
    dtypes = dtypes or [jnp.float32] * len(sizes)
    params = [jax.ShapeDtypeStruct((max(1, s // np.dtype(d).itemsize),), d)
              for s, d in zip(sizes, dtypes, strict=True)]
    return make_plan(params, list(range(len(params))))


def _decide(plan, platform="cpu", n=8, policy=None):
    return modelcap.decide(plan, platform, n, policy or ModelCap(), DEFAULT)


def test_merge_false_never_merges_ddps_buckets():
    """Property-style, 150 random models: ModelCap(merge=False) never picks fewer buckets than
    DDP's plan, and picks what the default policy picks whenever that has at least as many;
    the default policy (the default plan's) may merge."""
    rng = np.random.default_rng(1)
    merged = 0
    policy = modelcap.DefaultPlan().policy
    assert policy.merge is True and policy == ModelCap()
    keep = ModelCap(merge=False)
    for _ in range(150):
        n = int(rng.integers(1, 25))
        sizes = [int(x) for x in np.exp(rng.uniform(np.log(1e3), np.log(40 * MiB), n))]
        plan = _plan(sizes)
        free, kept = _decide(plan, policy=policy), _decide(plan, policy=keep)
        assert kept.num_buckets[_k(kept)] >= kept.num_buckets[0]
        if free.num_buckets[_k(free)] >= free.num_buckets[0]:
            assert (kept.cap_mb, kept.chosen_first_mb) == (free.cap_mb, free.chosen_first_mb)
        else:
            merged += 1
    assert merged > 0  # the rule was exercised
    with pytest.raises(TypeError, match="ModelCap.merge must be True or False"):
        ModelCap(merge="no")


def _k(c):
    """The chosen candidate's index (a cap can appear twice: with and without a first bucket)."""
    return list(zip(c.candidates_mb, c.first_mb, strict=True)).index((c.cap_mb, c.chosen_first_mb))


def _sizes(nbytes, dtypes, cap_mb, first_mb):
    cap = int(cap_mb * MiB)
    first = min(int(first_mb * MiB), cap)
    return tuple(sum(nbytes[k] for k in b) for b in assign_buckets(nbytes, dtypes, cap, first))


def test_the_rules_hold_on_random_models():
    """Property-style, 150 random models: the choice is the cheapest prediction, replaces DDP's
    plan only above the margin, is pinned by its own arguments, and is the same every time."""
    rng = np.random.default_rng(0)
    replaced = 0
    for _ in range(150):
        n = int(rng.integers(1, 25))
        sizes = [int(x) for x in np.exp(rng.uniform(np.log(1e3), np.log(40 * MiB), n))]
        dtypes = [jnp.float32 if rng.random() < 0.8 else jnp.bfloat16 for _ in range(n)]
        plan = _plan(sizes, dtypes)
        c = _decide(plan)
        again = _decide(plan)
        assert c._replace(tune_s=0) == again._replace(tune_s=0)
        assert (c.candidates_mb[0], c.first_mb[0]) == DEFAULT and c.method == "model"
        nbytes, dts = modelcap.backward_sizes(plan)
        plans = [_sizes(nbytes, dts, cap, first)
                 for cap, first in zip(c.candidates_mb, c.first_mb, strict=True)]
        assert len(set(plans)) == len(plans)  # distinct candidates
        assert [len(p) for p in plans] == list(c.num_buckets)
        k = _k(c)
        preds = c.predicted_s
        assert preds[k] <= preds[0]
        if k:
            replaced += 1
            assert preds[k] == min(preds)
            assert 1 - preds[k] / preds[0] > ModelCap().margin
            assert "DDP's plan (" in c.note
        else:
            assert min(preds) >= preds[0] * (1 - ModelCap().margin)
            assert "kept" in c.note
        # The pin reproduces the plan: an explicit cap alone caps the first bucket too.
        kw = dict(cap_mb=c.cap_mb)
        if "first_mb" in c.pin:
            kw["first_mb"] = c.chosen_first_mb
        assert c.pin == "reduce=jddp.Buckets({})".format(
            ", ".join(f"{a}={b:g}" for a, b in kw.items()))
        pinned = make_plan([jax.ShapeDtypeStruct(s, d) for s, d in
                            zip(plan.shapes, plan.dtypes, strict=True)],
                           list(range(n)), **kw)
        assert sorted(b.nbytes for b in pinned.buckets) == sorted(plans[k])
    assert replaced > 30  # the rule is exercised both ways


def test_benchmark_shapes():
    """The peers.py models' gradient shapes: the 11.5M MLP (8 x 5.5 MiB kernels) gets buckets of
    at most ~16.5 MiB, not DDP's 27.5 MiB middle bucket; the conv net (one 12 MiB dense kernel
    and 0.36 MiB of convolutions) gets one bucket; the small ResNet keeps DDP's one bucket."""
    mlp = []
    for _ in range(8):
        mlp += [1200 * 4, 1200 * 1200 * 4]
    c = _decide(_plan(mlp[::-1]))
    assert _k(c) and max(_sizes(*modelcap.backward_sizes(_plan(mlp[::-1])), c.cap_mb,
                            c.chosen_first_mb)) < 17 * MiB
    conv = [40, 15360, 1536, 8192 * 384 * 4, 512, 294912, 256, 73728, 128, 3456]
    c = _decide(_plan(conv[::-1]))
    assert c.num_buckets[_k(c)] == 1 and c.num_buckets[0] == 2
    assert c.pin == "reduce=jddp.Buckets(cap_mb=25)"
    small = _decide(_plan([700_000 // 60] * 60))
    assert small.cap_mb == 25.0 and small.chosen_first_mb == 1.0 and "kept" in small.note


def test_no_calibration_or_one_device_keeps_ddps_plan():
    plan = _plan([8 * MiB] * 6)
    gpu = _decide(plan, platform="gpu")
    assert (gpu.cap_mb, gpu.chosen_first_mb) == DEFAULT and math.isnan(gpu.predicted_s[0])
    assert "no built-in calibration for platform 'gpu'" in gpu.note
    one = _decide(plan, n=1)
    assert (one.cap_mb, one.chosen_first_mb) == DEFAULT and "nothing to reduce" in one.note
    # A described machine is used on any platform: a slow-latency serial cluster wants few,
    # large buckets.
    slow = ClusterSpec(8, async_collectives=False, allreduce_table=((0, 1.0), (64 * MiB, 1.1)))
    c = _decide(plan, platform="gpu", policy=ModelCap(cluster=slow))
    assert c.num_buckets[_k(c)] == 1


def _two_layer():
    """A 1.25 MiB and a 0.25 MiB kernel: DDP's plan is 2 buckets, the CPU model's is one (which
    the default plan, never merging, does not take)."""
    params = {"a": jnp.full((256, 256), 0.01, jnp.float32),
              "b": jnp.full((256, 1280), 0.01, jnp.float32)}

    def loss(p, batch):
        h = jnp.tanh(batch["x"] @ p["a"])
        return jnp.mean((h @ p["b"] - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    batches = [{"x": jnp.asarray(rng.normal(size=(16, 256)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(16, 1280)), jnp.float32)} for _ in range(2)]
    return loss, params, batches


def test_model_step_plans_before_running_trains_like_ddp_and_is_deterministic():
    loss, params, batches = _two_layer()
    ddp = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(cap_mb="model"))
    # DDP's default plan, pinned (given no cap, DataParallel takes the model's plan too).
    fixed = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(cap_mb=25.0,
                                                                          first_mb=1.0))
    assert ddp.cap_choice is None
    plan = ddp.plan(params, batches[0])  # chosen here, from the trace: nothing compiled or run
    choice = ddp.cap_choice
    assert isinstance(choice, CapChoice) and choice.method == "model" and choice.rounds == 0
    assert plan.num_buckets == 1 and fixed.plan(params, batches[0]).num_buckets == 2
    assert choice.pin == "reduce=jddp.Buckets(cap_mb=25)"
    assert ddp.config.reduce.first_bytes == 25 * MiB
    assert "Buckets(cap_mb='model') chose" in str(choice) and "<- chosen" in str(choice)
    # The same plan when computed again, by another trainer, and on a two-host layout (the
    # device count is what the choice reads, not the process or host count).
    again = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(cap_mb="model"))
    hosts = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(cap_mb="model"),
                              mesh=jddp.data_mesh(hosts=2))
    for other in (again, hosts):
        assert other.plan(params, batches[0]).buckets == plan.buckets
        assert other.cap_choice._replace(tune_s=0) == choice._replace(tune_s=0)
    assert ddp.plan(params, batches[0]).buckets == plan.buckets
    pinned = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(cap_mb=25.0))
    assert pinned.plan(params, batches[0]).buckets == plan.buckets
    # Training equals DDP's plan (a bucket changes only which leaves share an all-reduce).
    sm, sf = ddp.init(params), fixed.init(params)
    for b in batches:
        sm, mm = ddp.step(sm, b)
        sf, mf = fixed.step(sf, b)
        np.testing.assert_allclose(float(mm["loss"]), float(mf["loss"]), rtol=1e-6)
    assert max_abs_diff(sm.params, sf.params) < 1e-6
    assert ddp.step.cache_size() == 1 and ddp.cap_choice is choice
    assert "Buckets(cap_mb='model')" in str(ddp.bucket_plan) and ddp.bucket_plan.num_buckets == 1


def test_lower_chooses_first():
    loss, params, batches = _two_layer()
    ddp = jddp.DataParallel(loss, optax.sgd(0.1), reduce=jddp.Buckets(cap_mb="model"))
    text = ddp.lower(params, batches[0]).as_text()
    assert ddp.cap_choice is not None and text.count("all_reduce") >= 1


def test_bad_model_options():
    loss, params, _ = _two_layer()
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="chooses the first bucket too"):
        jddp.DataParallel(loss, opt, reduce=jddp.Buckets(cap_mb="model", first_mb=1.0))
    with pytest.raises(ValueError, match="cap_mb='model'\\) chooses the bucket plan"):
        jddp.DataParallel(loss, opt, reduce=jddp.Buckets(
            cap_mb="model", plan=jddp.DataParallel(loss, opt).plan(params, _two_layer()[2][0])))
    with pytest.raises(ValueError, match="'auto' \\(timed\\) or 'model'"):
        jddp.DataParallel(loss, opt, reduce=jddp.Buckets(cap_mb="models"))
    with pytest.raises(ValueError, match="margin"):
        ModelCap(margin=1.0)
    with pytest.raises(ValueError, match="candidates_mb"):
        ModelCap(candidates_mb=(1.0, -2.0))
    with pytest.raises(ValueError, match="backward_s"):
        ModelCap(cluster=ClusterSpec(8))
    with pytest.raises(TypeError, match="ClusterSpec"):
        ModelCap(cluster="cpu")
    assert ModelCap(cluster=ClusterSpec(8), backward_s=0.1).backward_s == 0.1


@pytest.mark.parametrize("opts", [{"place": jddp.ZeRO(stage=3)},
                                  {"accumulate": jddp.Accumulate(steps=2)}])
def test_model_combines_with_sharded_stages_and_accumulation(opts):
    """The chosen plan drives the other step layouts too (stage 3's gathers, accumulation's
    synchronising call); training equals the pinned plan's to 1e-6."""
    loss, params, batches = _two_layer()
    states = []
    for cap in ("model", 25.0):
        ddp = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(cap_mb=cap), **opts)
        state = ddp.init(params)
        for b in batches:
            state, _ = ddp.step(state, b)
        states.append(jax.tree.map(np.asarray, state.params))
        assert ddp.bucket_plan.num_buckets == 1
    assert max_abs_diff(states[0], states[1]) < 1e-6


# ------------------------------------------------------------- the default plan (no cap given)


def _bench_mlp():
    """benchmarks/_mlp.py's 11.5M-parameter MLP (width 1200, 8 layers), as shape structs, with
    a loss that counts its traces, and DDP's own packing of its leaves (25 MiB, 1 MiB first)."""
    calls = []

    def loss(p, b):
        calls.append(1)
        x = b["x"]
        for i in range(len(p)):
            x = x @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
            x = jnp.tanh(x) if i < len(p) - 1 else x
        return jnp.mean((x - b["y"]) ** 2)

    f32 = jnp.float32
    params = {f"Dense_{i}": {"kernel": jax.ShapeDtypeStruct((1200, 1200), f32),
                             "bias": jax.ShapeDtypeStruct((1200,), f32)} for i in range(8)}
    batch = {"x": jax.ShapeDtypeStruct((256, 1200), f32),
             "y": jax.ShapeDtypeStruct((256, 1200), f32)}
    return loss, calls, params, batch


def test_default_is_the_models_plan_chosen_in_the_steps_one_trace():
    """No cap given: the 11.5M MLP gets the cost model's plan (4 buckets of 11 MiB, where DDP's
    default makes 1, 27.5 and 16.5 MiB), chosen inside the step's trace: lowering the step runs
    the user's loss once, and the program has one all-reduce per chosen bucket."""
    loss, calls, params, batch = _bench_mlp()
    ddp = jddp.DataParallel(loss, optax.sgd(0.1, momentum=0.9))
    assert ddp.cap_choice is None
    assert isinstance(ddp.config.reduce.default_plan, modelcap.DefaultPlan)
    compiled = ddp.step.lower(ddp.abstract_state(params), batch).compile()
    assert len(calls) == 1
    plan, choice = ddp.bucket_plan, ddp.cap_choice
    assert choice.method == "default" and choice.pin == "reduce=jddp.Buckets(cap_mb=8)"
    assert [b.nbytes for b in plan.buckets] == [2 * (1200 * 1200 + 1200) * 4] * 4
    assert "the default plan, chosen by the cost model" in plan.note and choice.pin in plan.note
    assert "the default plan (no cap given) chose cap 8 MiB" in str(choice)
    ddps = jddp.DataParallel(loss, optax.sgd(0.1, momentum=0.9),
                             reduce=jddp.Buckets(cap_mb=25.0, first_mb=1.0))
    ddps_compiled = ddps.step.lower(ddps.abstract_state(params), batch).compile()
    assert ddps.bucket_plan.num_buckets == 3 and ddps.cap_choice is None
    # One all-reduce per bucket (the loss rides on the last: 4 bytes).
    reduced = lambda c: [x.nbytes for x in hlo.collectives(c, "all-reduce")]
    assert reduced(compiled) == [b.nbytes for b in plan.buckets[:-1]] + [plan.buckets[-1].nbytes + 4]
    assert reduced(ddps_compiled) == [5764800, 28824000, 11529604]
    # ddp.plan reports the same plan (its own trace, as before); "model" and the pin agree.
    assert ddp.plan(params, batch) == plan
    model = jddp.DataParallel(loss, optax.sgd(0.1), reduce=jddp.Buckets(cap_mb="model"))
    assert model.plan(params, batch).buckets == plan.buckets
    assert model.cap_choice._replace(tune_s=0, method="default") == choice._replace(tune_s=0)
    pinned = jddp.DataParallel(loss, optax.sgd(0.1), reduce=jddp.Buckets(cap_mb=8.0))
    assert pinned.plan(params, batch).buckets == plan.buckets


def test_a_given_cap_keeps_ddps_rule():
    """Buckets(cap_mb=25) packs by DDP's rule exactly (no first bucket, torch's partition),
    with no policy; first_mb alone also fixes DDP's default; plan= is used as given."""
    loss, _, params, batch = _bench_mlp()
    opt = optax.sgd(0.1)
    for kw, sizes in (({"cap_mb": 25.0}, [10, 6]), ({"first_mb": 1.0}, [2, 10, 4]),
                      ({"cap_mb": 25.0, "first_mb": 1.0}, [2, 10, 4])):
        ddp = jddp.DataParallel(loss, opt, reduce=jddp.Buckets(**kw))
        plan = ddp.plan(params, batch)
        assert ddp.config.reduce.default_plan is None and ddp.cap_choice is None and plan.note == ""
        assert [len(b.indices) for b in plan.buckets] == sizes
        assert plan == jddp.plan_buckets(loss, params, batch, **kw)
    fixed = jddp.DataParallel(loss, opt, reduce=jddp.Buckets(plan=plan))
    assert fixed.config.reduce.default_plan is None and fixed.plan(params, batch) == plan


def test_small_models_keep_ddps_plan():
    """A model whose gradients fit DDP's first bucket: the default plan is DDP's, bit for bit
    (no note), and the choice says so."""
    sizes = [6, 64, 64, 3]
    params, batch = _models.mlp_params(0, sizes), _models.regression_batch(0, 32, 6, 3)
    ddp = jddp.DataParallel(_models.mlp_loss, optax.sgd(0.1))
    plan = ddp.plan(params, batch)
    assert plan == jddp.plan_buckets(_models.mlp_loss, params, batch)
    assert plan.num_buckets == 1 and "DDP's plan is kept" in ddp.cap_choice.note


@pytest.mark.parametrize("opts", [{"place": jddp.ZeRO(stage=1)},
                                  {"reduce": jddp.Buckets(hook=jddp.bf16_compress())},
                                  {"sync": jddp.local_sgd.diloco(4)}])
def test_default_is_ddps_plan_where_the_table_was_not_measured(opts):
    """Sharded stages, other hooks, local SGD (and the deterministic step, which has no
    buckets) keep DDP's 25 MiB plan with a 1 MiB first bucket by default."""
    loss, params, batches = _two_layer()
    ddp = jddp.DataParallel(loss, optax.sgd(0.1), **opts)
    reduce = ddp.config.reduce
    assert reduce.default_plan is None and reduce.cap_bytes == 25 * MiB
    assert reduce.first_bytes == MiB and ddp.cap_choice is None
    assert ddp.plan(params, batches[0]).num_buckets == 2
    mean = jddp.hooks.allreduce_mean()
    assert modelcap.default_plan(mean, False, False) == modelcap.DefaultPlan()
    assert modelcap.default_plan(mean, True, False) is None
    assert modelcap.default_plan(mean, False, True) is None
    assert modelcap.default_plan(jddp.bf16_compress(), False, False) is None
    # The deterministic reduction has no buckets to choose: it is its own reducer, no chooser.
    assert jddp.Deterministic().choice(ddp.plan(params, batches[0]), "cpu", 8) is None


def test_default_keeps_ddps_plan_without_calibration_and_is_a_pure_function():
    """On GPU/TPU (no built-in table) the policy returns DDP's plan itself and bounds XLA's
    combine thresholds by DDP's cap; on CPU the same inputs give the same plan every time and
    on a two-host 8-device layout (what every process of a job computes, with no exchange)."""
    loss, params, batches = _two_layer()
    ddp = jddp.DataParallel(loss, optax.sgd(0.1), reduce=jddp.Buckets(cap_mb=25.0, first_mb=1.0))
    ddps = ddp.plan(params, batches[0])
    policy = modelcap.DefaultPlan()
    packed = []

    def pack(cap, first):
        packed.append((cap, first))
        return ddps._replace(cap_bytes=cap, first_bytes=first)

    for platform in ("gpu", "tpu"):
        assert policy.repack(ddps, pack, platform, 8) is ddps and not packed
        assert "no built-in calibration" in policy.choose(ddps, platform, 8).note
        assert policy.max_cap_bytes(platform) == 25 * MiB
    assert policy.max_cap_bytes("cpu") == 100 * MiB
    # On CPU the model merges DDP's two buckets into one (ModelCap(merge=False) would not).
    keeping = modelcap.DefaultPlan(ModelCap(merge=False))
    assert keeping.repack(ddps, pack, "cpu", 8) is ddps and not packed
    assert "with at least DDP's 2 bucket(s)" in keeping.choose(ddps, "cpu", 8).note
    first = policy.repack(ddps, pack, "cpu", 8)
    choice = policy.choose(ddps, "cpu", 8)
    assert policy.repack(ddps, pack, "cpu", 8) == first and packed == [(25 * MiB, 25 * MiB)] * 2
    # A value: the choice is the same asked of the repacked plan (the same leaves), and the
    # policy holds no record of it (frozen, equal to a fresh one).
    assert policy.choose(first, "cpu", 8)._replace(tune_s=0) == choice._replace(tune_s=0)
    assert policy == modelcap.DefaultPlan() and hash(policy) == hash(modelcap.DefaultPlan())
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.policy = ModelCap()  # type: ignore[misc]
    one, two = (jddp.DataParallel(loss, optax.sgd(0.1), mesh=m)
                for m in (jddp.data_mesh(), jddp.data_mesh(hosts=2)))
    pinned = jddp.DataParallel(loss, optax.sgd(0.1),
                               reduce=jddp.Buckets(cap_mb=choice.cap_mb,
                                                   first_mb=choice.chosen_first_mb)
                               ).plan(params, batches[0])
    assert one.plan(params, batches[0]) == two.plan(params, batches[0])
    assert one.plan(params, batches[0]).buckets == pinned.buckets
    assert pinned.num_buckets == 1 < ddps.num_buckets
    assert one.cap_choice._replace(tune_s=0) == two.cap_choice._replace(tune_s=0)
    assert one.config.reduce.largest_bucket("cpu", {}) == 100 * MiB  # the largest cap


# ---------------------------------------------- the default plan on 2 processes x 4 devices

DEFAULT_PLAN_JOB = r"""
import sys
import numpy as np
import jax
import jddp
jddp.initialize(timeout_s=60)
import optax
from benchmarks._mlp import mlp_loss, mlp_params

rng = np.random.default_rng(0)
batches = [{"x": rng.normal(size=(16, 1024)).astype(np.float32),
            "y": rng.normal(size=(16, 1024)).astype(np.float32)} for _ in range(3)]
mesh = jddp.data_mesh()
ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1, momentum=0.9), mesh=mesh)  # no cap: the default
runs = []
for _ in range(2):  # the second run reuses the compiled step
    state = ddp.init(mlp_params(1024, 6))
    for b in batches:
        state, _ = ddp.step(state, jddp.shard_batch(b, mesh))
    runs += [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(state.params)]
if jax.process_index() == 0:
    np.savez(sys.argv[1], *runs)
print("PLAN", [b.nbytes for b in ddp.bucket_plan.buckets], ddp.cap_choice.method,
      ddp.cap_choice.pin)
"""


@pytest.mark.slow
def test_default_plan_on_two_processes(tmp_path):
    """The default plan where it is not DDP's (a 6-layer 1024-wide MLP: 16 + 8 MiB, where DDP's
    makes 4 + 20 MiB) on 2 processes x 4 devices over Gloo: the same plan as on 1 x 8, two runs
    bitwise equal, equal to the 1 x 8 run and to the one-device reference."""
    from benchmarks._mlp import mlp_loss, mlp_params

    script = tmp_path / "job.py"
    script.write_text(DEFAULT_PLAN_JOB)
    rc, out, err, _ = run_launcher(["-n", "2", "--devices-per-process", "4", "--timeout", "120",
                                    str(script), str(tmp_path / "out.npz")], timeout=130)
    assert rc == 0, (out[-2000:], err[-3000:])
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(16, 1024)).astype(np.float32),
                "y": rng.normal(size=(16, 1024)).astype(np.float32)} for _ in range(3)]
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1, momentum=0.9))
    state = ddp.init(mlp_params(1024, 6))
    for b in batches:
        state, _ = ddp.step(state, jddp.shard_batch(b, ddp.mesh))
    one = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    sizes = [b.nbytes for b in ddp.bucket_plan.buckets]
    assert ddp.cap_choice.method == "default" and sizes == [16 * MiB + 16 * 1024, 8 * MiB + 8192]
    for rank in (0, 1):
        assert f"[rank{rank}] PLAN {sizes} default {ddp.cap_choice.pin}" in out, out[-2000:]
    with np.load(tmp_path / "out.npz") as z:
        got = [z[f"arr_{i}"] for i in range(len(z.files))]
    first, second = got[:len(one)], got[len(one):]
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    # float32 summation order (Gloo's all-reduce, the in-process one, one device): 1.5e-8 here,
    # where the three steps move the parameters by up to 5.5e-4.
    reference = ref.train(mlp_loss, optax.sgd(0.1, momentum=0.9), mlp_params(1024, 6),
                          [[b] for b in batches]).params
    assert max_abs_diff(first, one) < 1e-6
    assert max_abs_diff(first, jax.tree.leaves(reference)) < 1e-6
