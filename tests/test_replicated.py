"""The default plan leaves to JAX the leaves first combined with cross-replica statistics
(SyncBatchNorm's scales, ``BucketPlan.implicit``; jddp/_src/reduce/replicated.py): which leaves, where
(only where nothing else reads a bucket), equal training to the one-device reference and to the
all-bucket program, the same bytes, and 2 processes x 4 devices."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.step.skeleton import reduce_context
from tests._models import batch_stats_loss, max_abs_diff, sorted_regression_batch
from tests.launch_util import run_launcher


class _Net(nn.Module):
    axis_name: str | None = "data"

    @nn.compact
    def __call__(self, x, train=True):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9,  # noqa: E731
                                    axis_name=self.axis_name)
        x = nn.relu(norm()(nn.Dense(16)(x)))
        x = nn.relu(norm()(nn.Dense(16)(x)))
        return nn.Dense(3)(x)


def _setup(seed=0, n=32):
    batch = sorted_regression_batch(seed, n)
    variables = _Net(None).init(jax.random.key(seed), batch["x"][:2], train=False)
    return batch, variables["params"], {"batch_stats": variables["batch_stats"]}


_loss_fn = batch_stats_loss


def _scales(plan):
    return tuple(i for i, p in enumerate(plan.paths) if "BatchNorm" in p and p.endswith("scale"))


def test_default_plan_leaves_syncbn_scales_to_jax_and_trains_the_same():
    batch, params, ms = _setup()
    opt = optax.sgd(0.1, momentum=0.9)
    ddp = jddp.DataParallel(_loss_fn(_Net()), opt)  # no cap: the default plan
    given = jddp.DataParallel(_loss_fn(_Net()), opt,
                              reduce=jddp.Buckets(cap_mb=25))  # DDP's rule, every leaf
    plan = ddp.plan(params, batch, ms)
    # The scales meet rsqrt(var) (a pmean) first; the biases and kernels meet activations.
    assert plan.implicit == _scales(plan) and len(plan.implicit) == 2
    assert not set(plan.implicit) & {i for b in plan.buckets for i in b.indices}
    assert "2 leaves reduced by JAX" in str(plan) and "BatchNorm_0.scale" in str(plan)
    assert given.plan(params, batch, ms).implicit == ()

    state, other = ddp.init(params, ms), given.init(params, ms)
    single = _loss_fn(_Net(None))  # one device: BatchNorm over the whole batch
    ref_p, ref_ms, ref_opt = params, ms, opt.init(params)
    for _ in range(3):
        state, metrics = ddp.step(state, batch)
        other, other_metrics = given.step(other, batch)
        (loss, ref_ms), grads = jax.value_and_grad(single, has_aux=True)(ref_p, ref_ms, batch)
        updates, ref_opt = opt.update(grads, ref_opt, ref_p)
        ref_p = optax.apply_updates(ref_p, updates)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
        # JAX's psum of rsqrt(var) * scale's cotangent, the buckets' psum of the scale's: the
        # same bytes (both [16] floats a layer).
        assert float(metrics["comm_bytes"]) == float(other_metrics["comm_bytes"])
    assert max_abs_diff(state.params, ref_p) < 2e-5
    assert max_abs_diff(state.model_state, ref_ms) < 2e-5
    # Other summation points than the bucket's, float32 rounding apart.
    assert max_abs_diff(state.params, other.params) < 1e-6

    # The compiled programs: the buckets no longer hold the scales; the step sends what
    # comm_bytes says plus the model's own collectives: per layer the statistics' pmean
    # ([2, 16] floats) and the psum of the mean's cotangent ([1, 16]). The all-bucket program
    # also sums rsqrt(var)'s cotangent ([1, 16]): the replicated scale made it per-device.
    ring = lambda nbytes: 2 * 7 / 8 * nbytes  # noqa: E731  # one device's ring all-reduce
    rep, rep_given = ddp.report(state, batch), given.report(other, batch)
    bucketed = sum(c.bytes for c in rep.collectives if c.bucket is not None)
    bucketed_given = sum(c.bytes for c in rep_given.collectives if c.bucket is not None)
    assert bucketed == bucketed_given - 2 * 16 * 4
    model = 2 * ring(2 * 16 * 4 + 16 * 4)
    assert rep.sent_per_step == pytest.approx(float(metrics["comm_bytes"]) + model, rel=1e-9)
    assert rep_given.sent_per_step == pytest.approx(
        float(other_metrics["comm_bytes"]) + model + 2 * ring(16 * 4), rel=1e-9)


@pytest.mark.parametrize("kwargs", [
    {"reduce": jddp.Buckets(cap_mb=25)},
    {"reduce": jddp.Buckets(hook=jddp.hooks.fp16_compress())},
    {"accumulate": jddp.Accumulate(steps=2)},
    {"accumulate": jddp.Accumulate(microbatches=2)},
    {"place": jddp.ZeRO(stage=1)},
    {"precision": jddp.precision.MixedPrecision(param_dtype=jnp.bfloat16)},
])
def test_every_leaf_is_bucketed_where_something_else_reads_the_buckets(kwargs):
    """A cap given keeps DDP's rule for every leaf; a hook sees every gradient; no_sync calls
    must not communicate (JAX would reduce per micro-batch); a sharded stage splits every
    leaf; a mixed-precision policy casts the parameters first."""
    batch, params, ms = _setup()
    ddp = jddp.DataParallel(_loss_fn(_Net()), optax.sgd(0.1), **kwargs)
    plan = ddp.plan(params, batch, ms)
    assert plan.implicit == () and not ddp.config.reduce.jax_reduces(reduce_context(ddp.config))
    default = jddp.DataParallel(_loss_fn(_Net()), optax.sgd(0.1)).config
    assert default.reduce.jax_reduces(reduce_context(default))  # the bucketed reducer decides (on CPU here)
    assert sorted(i for b in plan.buckets for i in b.indices) == list(range(len(plan.paths)))


def test_per_device_batchnorm_and_plain_layers_keep_every_leaf_in_a_bucket():
    batch, params, ms = _setup()
    ddp = jddp.DataParallel(_loss_fn(_Net(None)), optax.sgd(0.1),
                            loss=jddp.Loss(model_state_sync="mean"))
    assert ddp.plan(params, batch, ms).implicit == ()


SYNCBN_JOB = r"""
import sys
import numpy as np
import jax
import jddp
jddp.initialize(timeout_s=60)
import optax
sys.path.insert(0, sys.argv[2])
from test_replicated import _Net, _loss_fn, _setup

batch, params, ms = _setup()
mesh = jddp.data_mesh()
ddp = jddp.DataParallel(_loss_fn(_Net()), optax.sgd(0.1, momentum=0.9), mesh=mesh)
runs = []
for _ in range(2):  # the second run reuses the compiled step
    state = ddp.init(params, ms)
    for _ in range(3):
        state, _ = ddp.step(state, jddp.shard_batch(batch, mesh))
    runs += [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(state.params)]
if jax.process_index() == 0:
    np.savez(sys.argv[1], *runs)
print("IMPLICIT", ddp.bucket_plan.implicit)
"""


@pytest.mark.slow
def test_syncbn_default_plan_on_two_processes(tmp_path):
    """2 processes x 4 devices over Gloo: the same leaves left to JAX on both, two runs bitwise
    equal, equal to the 1 x 8 run."""
    import os

    script = tmp_path / "job.py"
    script.write_text(SYNCBN_JOB)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    rc, out, err, _ = run_launcher(["-n", "2", "--devices-per-process", "4", "--timeout", "120",
                                    str(script), str(tmp_path / "out.npz"), tests_dir],
                                   timeout=130)
    assert rc == 0, (out[-2000:], err[-3000:])
    batch, params, ms = _setup()
    ddp = jddp.DataParallel(_loss_fn(_Net()), optax.sgd(0.1, momentum=0.9))
    state = ddp.init(params, ms)
    for _ in range(3):
        state, _ = ddp.step(state, batch)
    one = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    implicit = ddp.bucket_plan.implicit
    assert len(implicit) == 2
    for rank in (0, 1):
        assert f"[rank{rank}] IMPLICIT {implicit}" in out, out[-2000:]
    with np.load(tmp_path / "out.npz") as z:
        got = [z[f"arr_{i}"] for i in range(len(z.files))]
    first, second = got[:len(one)], got[len(one):]
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    assert max_abs_diff(first, one) < 1e-6


def test_a_metric_that_reads_a_scale_adds_no_bytes():
    """A metric computed from a scale read replicated is cast to per-device for the metrics'
    mean, but no gradient flows through that cast: no psum, nothing counted."""
    batch, params, ms = _setup()
    inner = _loss_fn(_Net())

    def loss_fn(params, model_state, batch):
        loss, updates = inner(params, model_state, batch)
        return loss, (updates, {"scale_sq": jnp.sum(params["BatchNorm_0"]["scale"] ** 2)})

    runs = {}
    for name, kwargs in {"default": {}, "given": {"reduce": jddp.Buckets(cap_mb=25)}}.items():
        ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), loss=jddp.Loss(has_aux=True), **kwargs)
        state, metrics = ddp.step(ddp.init(params, ms), batch)
        runs[name] = (ddp.bucket_plan.implicit, metrics, state)
    (implicit, metrics, state), (given, given_metrics, given_state) = runs["default"], runs["given"]
    assert len(implicit) == 2 and given == ()
    assert float(metrics["comm_bytes"]) == float(given_metrics["comm_bytes"])
    assert float(metrics["scale_sq"]) == float(given_metrics["scale_sq"]) == 16.0
    assert max_abs_diff(state.params, given_state.params) < 1e-6


def _stats(h, axis="data"):
    mean, sq = jnp.mean(h, 0), jnp.mean(h * h, 0)
    mean, sq = jax.lax.pmean((mean, sq), axis)
    return mean, jax.lax.rsqrt(sq - mean**2 + 1e-5)


def _norm_plain(p, h):
    mean, inv = _stats(h)
    return (h - mean) * (inv * p["scale"]) + p["bias"]


def _norm_twice(p, h):  # the scale meets the statistic and, again, the activations
    mean, inv = _stats(h)
    return (h - mean) * (inv * p["scale"]) + 0.1 * h * p["scale"] + p["bias"]


_norm_jit = jax.jit(_norm_plain)  # a plain call: walked into


def _norm_remat(p, h):  # a checkpointed block: cast at its boundary
    return jax.checkpoint(_norm_plain)(p, h)


def _norm_relu(p, h):  # a custom_jvp (relu) between the scale and the statistic
    mean, inv = _stats(h)
    return (h - mean) * (inv * jax.nn.relu(p["scale"])) + p["bias"]


def _norm_cond(p, h):  # a branch on a replicated statistic, the scale inside it
    mean, inv = _stats(h)
    factor = jax.lax.cond(jnp.sum(mean) > 0, lambda s: inv * s, lambda s: inv * s * 0.5,
                          p["scale"])
    return (h - mean) * factor + p["bias"]


@pytest.mark.parametrize("norm,expect", [
    (_norm_plain, ("scale",)), (_norm_twice, ("scale",)), (_norm_jit, ("scale",)),
    (_norm_remat, ()), (_norm_relu, ()), (_norm_cond, ()),
])
def test_late_casts_train_like_the_buckets(norm, expect):
    """Scales met by the statistic in plain code, twice, under jit, or beyond a checkpoint, a
    custom derivative or a branch: the leaves left to JAX are the ones the walk can see, and
    every variant trains like the all-bucket program; the program sends no more bytes, and
    comm_bytes counts JAX's psums for those leaves."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(6, 16)) / 3, jnp.float32),
              "scale": jnp.asarray(1 + 0.1 * rng.normal(size=16), jnp.float32),
              "bias": jnp.asarray(0.1 * rng.normal(size=16), jnp.float32),
              "out": jnp.asarray(rng.normal(size=(16, 3)) / 4, jnp.float32)}
    batch = {"x": rng.normal(size=(32, 6)).astype(np.float32),
             "y": rng.normal(size=(32, 3)).astype(np.float32)}

    def loss(p, b):
        h = jnp.tanh(norm(p, b["x"] @ p["w"]))
        return jnp.mean((h @ p["out"] - b["y"]) ** 2)

    runs = {}
    for name, kwargs in {"default": {}, "given": {"reduce": jddp.Buckets(cap_mb=25)}}.items():
        ddp = jddp.DataParallel(loss, optax.sgd(0.1, momentum=0.9), **kwargs)
        state = ddp.init(params)
        for _ in range(3):
            state, metrics = ddp.step(state, batch)
        runs[name] = (ddp.bucket_plan, state.params, float(metrics["comm_bytes"]),
                      ddp.report(state, batch).sent_per_step)
    (plan, got, sent, total), (_, want, sent_given, total_given) = runs["default"], runs["given"]
    assert tuple(plan.paths[i] for i in plan.implicit) == expect
    assert max_abs_diff(got, want) < 1e-6
    if not expect:  # every leaf bucketed: the same program
        assert (sent, total) == (sent_given, total_given)
        return
    # The program sends no more; what it sends beyond comm_bytes is the model's own: the
    # statistics' pmean ([2, 16] floats) and the psum of the mean's cotangent ([16]). A scale
    # also used on the activations is cast (and summed) there too: counted in comm_bytes.
    assert total <= total_given
    assert total - sent == pytest.approx(2 * 7 / 8 * (2 * 16 * 4 + 16 * 4), rel=1e-9)


def test_two_level_mesh():
    """Statistics over both axes of a hosts x local mesh: the scales left to JAX, equal
    training to the all-bucket program, and the same bytes in all and across hosts."""
    batch, params, ms = _setup()
    mesh = jddp.data_mesh(hosts=2)
    loss = _loss_fn(_Net(("hosts", "local")))
    runs = {}
    for name, kwargs in {"default": {}, "given": {"reduce": jddp.Buckets(cap_mb=25)}}.items():
        ddp = jddp.DataParallel(loss, optax.sgd(0.1), mesh=mesh, **kwargs)
        state = ddp.init(params, ms)
        for _ in range(2):
            state, metrics = ddp.step(state, jddp.shard_batch(batch, mesh))
        runs[name] = (ddp.bucket_plan.implicit, state.params,
                      float(metrics["comm_bytes"]), float(metrics["comm_bytes_hosts"]))
    (implicit, got, sent, hosts), (given, want, sent_given, hosts_given) = runs.values()
    assert len(implicit) == 2 and given == ()
    assert max_abs_diff(got, want) < 1e-6
    assert (sent, hosts) == (sent_given, hosts_given) and hosts > 0


def test_nnx_syncbn():
    """``jddp.nnx``: an ``nnx.BatchNorm(axis_name="data")`` scale left to JAX, training equal to
    the all-bucket program and to one device with the whole batch's statistics."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, axis_name, rngs):
            self.l1 = nnx.Linear(6, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, momentum=0.9, axis_name=axis_name, rngs=rngs)
            self.out = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.bn(self.l1(x))))

    def mse(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    batch = sorted_regression_batch(3)
    runs = {}
    for name, kwargs in {"default": {}, "given": {"reduce": jddp.Buckets(cap_mb=25)}}.items():
        ddp = jddp.nnx.DataParallel(Net("data", nnx.Rngs(0)), optax.sgd(0.1), loss_fn=mse,
                                    **kwargs)
        state = ddp.init()
        for _ in range(3):
            state, _ = ddp.step(state, batch)
        plan = ddp.bucket_plan
        runs[name] = ([plan.paths[i] for i in plan.implicit], state.params)
    (implicit, got), (given, want) = runs["default"], runs["given"]
    assert implicit == ["bn.scale.value"]
    assert given == []
    assert max_abs_diff(got, want) < 1e-6

    model = Net(None, nnx.Rngs(0))  # one device: the whole batch's statistics
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    for _ in range(3):
        grads = nnx.grad(mse)(model, batch)
        opt.update(model, grads)
    assert max_abs_diff(jax.tree.leaves(got), jax.tree.leaves(nnx.state(model, nnx.Param))) < 2e-5
