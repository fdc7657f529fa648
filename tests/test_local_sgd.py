"""Local SGD (post-local SGD) and DiLoCo: parity with hand-written references of both algorithms,
H = 1 equals DDP, the compiled programs (no cross-replica collective on a local step, one
all-reduce per bucket on an averaging step), model state, checkpoints, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.perf import schedule
from jddp.perf.traffic import traffic
from tests._models import max_abs_diff, mlp_loss, mlp_params, regression_batch

SIZES = [6, 16, 16, 3]
CAPS = dict(bucket_cap_mb=0.002, first_bucket_mb=0.001)  # 2 buckets
DEVICES = 8


def _stateful_loss(p, ms, b):
    """The MLP loss, and a running mean of the inputs as model state (averaged with "mean")."""
    new = {"mu": 0.9 * ms["mu"] + 0.1 * jnp.mean(b["x"], axis=0)}
    return mlp_loss(p, b), new


def _batches(steps, n=32, seed=0):
    return [regression_batch(seed + i, n, SIZES[0], SIZES[-1]) for i in range(steps)]


def _mesh(hosts):
    return jddp.data_mesh() if hosts is None else jddp.data_mesh(hosts=hosts)


def _reference(params, ms, inner, spec, batches, replicas, stateful):
    """The algorithm written out on one device: ``replicas`` copies, each device's gradient on its
    shard, replicas' gradients (and "mean" model state) averaged over their devices, the optax
    update per replica, and every ``spec.kind(step) == "average"`` step a parameter average
    (post-local SGD) or an outer step on the averaged delta (DiLoCo)."""
    per = DEVICES // replicas
    ps = [params] * replicas
    opts = [inner.init(params)] * replicas
    mss = [ms] * replicas
    anchor = params
    outer = spec.outer_optimizer.init(params) if spec.diloco else None

    def dev_grad(p, m, shard):
        if stateful:
            (_, new), g = jax.value_and_grad(_stateful_loss, has_aux=True)(p, m, shard)
            return g, new
        return jax.grad(mlp_loss)(p, shard), None

    mean = lambda trees: jax.tree.map(lambda *x: sum(x) / len(x), *trees)
    for step, batch in enumerate(batches):
        kind = spec.kind(step)
        b = batch["x"].shape[0] // DEVICES
        shards = [jax.tree.map(lambda x, d=d, b=b: x[d * b:(d + 1) * b], batch)
                  for d in range(DEVICES)]
        out = [dev_grad(ps[d // per], mss[d // per], shards[d]) for d in range(DEVICES)]
        if kind == "sync":
            g_all = mean([g for g, _ in out])
            grads = [g_all] * replicas
            if stateful:
                mss = [mean([m for _, m in out])] * replicas
        else:
            grads = [mean([out[d][0] for d in range(r * per, (r + 1) * per)])
                     for r in range(replicas)]
            if stateful:
                mss = [mean([out[d][1] for d in range(r * per, (r + 1) * per)])
                       for r in range(replicas)]
        for r in range(replicas):
            upd, opts[r] = inner.update(grads[r], opts[r], ps[r])
            ps[r] = optax.apply_updates(ps[r], upd)
        if kind == "average":
            if spec.diloco:
                delta = mean([jax.tree.map(lambda a, p: a - p, anchor, q) for q in ps])
                upd, outer = spec.outer_optimizer.update(delta, outer, anchor)
                anchor = optax.apply_updates(anchor, upd)
                ps = [anchor] * replicas
            else:
                ps = [mean(ps)] * replicas
            if stateful:
                mss = [mean(mss)] * replicas
    return ps, mss, anchor


def _run(spec, inner, batches, hosts, stateful, **kw):
    loss = _stateful_loss if stateful else mlp_loss
    ddp = jddp.DataParallel(loss, inner, mesh=_mesh(hosts), local_sgd=spec,
                            model_state_sync="mean", **CAPS, **kw)
    params = mlp_params(0, SIZES)
    ms = {"mu": jnp.zeros((SIZES[0],), jnp.float32)}
    state = ddp.init(params, ms) if stateful else ddp.init(params)
    metrics = []
    for b in batches:
        state, m = ddp.step(state, b)
        metrics.append(m)
    return ddp, state, metrics, params, ms


@pytest.mark.parametrize("hosts", [None, 2])
@pytest.mark.parametrize("algo", ["post_local_sgd", "diloco"])
def test_matches_hand_written_reference(algo, hosts):
    """8 steps of Adam(W): every replica's params and model state equal the reference's (1e-5),
    through sync, local and averaging steps, on a 1-D mesh (8 replicas) and on 2 hosts x 4
    devices (2 replicas, gradients and model state reduced inside the host every step)."""
    if algo == "post_local_sgd":
        spec, inner = jddp.local_sgd.post_local_sgd(3, start_step=2), optax.adam(1e-2)
    else:
        spec, inner = jddp.local_sgd.diloco(3), optax.adamw(1e-2, weight_decay=0.1)
    batches = _batches(8)
    ddp, state, metrics, params, ms = _run(spec, inner, batches, hosts, stateful=True)
    replicas = DEVICES if hosts is None else hosts
    ref_ps, ref_ms, ref_anchor = _reference(params, ms, inner, spec, batches, replicas, True)
    for r in range(replicas):
        got = jax.tree.map(lambda x, r=r: np.asarray(x)[r], state.params)
        assert max_abs_diff(got, ref_ps[r]) < 1e-5, (r, max_abs_diff(got, ref_ps[r]))
        got_ms = jax.tree.map(lambda x, r=r: np.asarray(x)[r], state.model_state)
        assert max_abs_diff(got_ms, ref_ms[r]) < 1e-6
    # The replicas really trained apart: after the last (local) step they differ.
    assert spec.kind(7) == "local"
    assert max_abs_diff(ref_ps[0], ref_ps[1]) > 1e-4
    assert max_abs_diff(jax.tree.map(lambda x: np.asarray(x)[1], state.params), ref_ps[0]) > 1e-4
    if spec.diloco:
        assert max_abs_diff(state.outer.params, ref_anchor) < 1e-5
        assert max_abs_diff(ddp.global_params(state), ref_anchor) < 1e-5
    kinds = [spec.kind(i) for i in range(8)]
    assert [bool(m["averaged"]) for m in metrics] == [k != "local" for k in kinds]
    for m, k in zip(metrics, kinds, strict=True):
        assert m["replica_loss"].shape == (replicas,)
        assert np.isnan(float(m["loss"])) == (k == "local")
    ddp.verify(state)  # copies inside each host agree (and the step everywhere)


def test_period_one_equals_ddp_for_sgd():
    """PyTorch's parity check: averaging every step (H = 1) after local SGD steps is DDP."""
    batches = _batches(5)
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), **CAPS)
    state = ddp.init(params)
    lsgd = jddp.DataParallel(mlp_loss, optax.sgd(0.1), local_sgd=jddp.local_sgd.post_local_sgd(1),
                             **CAPS)
    lstate = lsgd.init(params)
    for b in batches:
        state, m = ddp.step(state, b)
        lstate, lm = lsgd.step(lstate, b)
        assert abs(float(m["loss"]) - float(lm["loss"])) < 1e-6
    for r in range(DEVICES):
        assert max_abs_diff(jax.tree.map(lambda x, r=r: np.asarray(x)[r], lstate.params),
                            state.params) < 1e-6
    assert max_abs_diff(lsgd.global_params(lstate), state.params) < 1e-6


def test_diloco_with_plain_outer_step_averages_parameters():
    """DiLoCo with outer SGD(1.0) and no momentum moves the global params to the replicas' mean:
    parameter averaging (post-local SGD's averaging) on DiLoCo's schedule."""
    spec = jddp.local_sgd.diloco(2, optax.sgd(1.0))
    batches = _batches(6)
    _, state, _, params, _ = _run(spec, optax.adam(1e-2), batches, 2, False)

    class Averaging:  # the reference's plain averaging, at the steps DiLoCo takes outer steps
        diloco = False
        kind = staticmethod(spec.kind)

    ref_ps, _, _ = _reference(params, None, optax.adam(1e-2), Averaging(), batches, 2, False)
    assert [spec.kind(i) for i in range(4)] == ["local", "average"] * 2
    for r in range(2):
        got = jax.tree.map(lambda x, r=r: np.asarray(x)[r], state.params)
        assert max_abs_diff(got, ref_ps[r]) < 1e-6
    assert max_abs_diff(state.outer.params, ref_ps[0]) < 1e-6


def _kinds_text(ddp, step):
    params = mlp_params(0, SIZES)
    return ddp.lower(params, regression_batch(0, 32, SIZES[0], SIZES[-1]), step=step) \
        .compile().as_text()


@pytest.mark.parametrize("hosts", [None, 2])
def test_compiled_local_and_averaging_steps(hosts):
    """A local step has no cross-replica collective (none at all on a 1-D mesh, only in-host
    gradient all-reduces on 2 hosts); an averaging step adds exactly one cross-replica all-reduce
    per bucket, in bucket order (the loss rides on the last one)."""
    mesh = _mesh(hosts)
    spec = jddp.local_sgd.diloco(4)
    ddp = jddp.DataParallel(mlp_loss, optax.adamw(1e-3), mesh=mesh, local_sgd=spec, **CAPS)
    host = jddp.mesh.host_of_device(mesh)
    local = traffic(_kinds_text(ddp, 0), host)
    plan = ddp.bucket_plan
    assert plan.num_buckets == 2
    avg_text = _kinds_text(ddp, 3)
    avg = traffic(avg_text, host)
    assert spec.kind(0) == "local" and spec.kind(3) == "average"
    if hosts is None:
        assert local.collectives == ()
        # Every device is a replica: the averaging all-reduces are the only collectives.
        ars = schedule.read_schedule(avg_text).all_reduces
        assert len(ars) == len(avg.collectives) == plan.num_buckets
        for ar, bucket in zip(ars, plan.buckets, strict=True):
            assert ar.nbytes - bucket.nbytes in (0, 4)  # + the loss on the last bucket
    else:
        assert local.by_kind(crosses=True) == {}
        assert local.by_kind(crosses=False) == {"all-reduce": plan.num_buckets}
        across = [c for c in avg.collectives if c.crosses]
        assert [c.collective.kind for c in across] == ["all-reduce"] * plan.num_buckets
        # Each device averages 1/4 of each bucket across hosts (a host sends it once, not 4x).
        for c, bucket in zip(across, plan.buckets, strict=True):
            assert bucket.nbytes / 4 <= c.collective.nbytes <= bucket.nbytes / 4 + 64
        # A host sends 2 (H-1)/H x the parameter bytes across (the ring model), not 4x that.
        total = sum(b.nbytes for b in plan.buckets)
        assert total <= avg.across <= 1.05 * total + 64


def test_checkpoint_resume_mid_period_is_bit_exact(tmp_path):
    """A DiLoCo run on 2 hosts x 4 devices with model state, saved after step 5 of a period of 4
    (between two outer steps), restored and continued, equals the uninterrupted run bit for bit."""
    import jddp.checkpoint as ckpt

    spec = jddp.local_sgd.diloco(4)
    batches = _batches(9)

    def make():
        return jddp.DataParallel(_stateful_loss, optax.adamw(1e-2), mesh=_mesh(2), local_sgd=spec,
                                 model_state_sync="mean", **CAPS)

    params = mlp_params(0, SIZES)
    ms = {"mu": jnp.zeros((SIZES[0],), jnp.float32)}
    ddp = make()
    state = ddp.init(params, ms)
    mngr = ckpt.manager(tmp_path / "ck")
    for i, b in enumerate(batches):
        state, _ = ddp.step(state, b)
        if i == 5:
            ckpt.save(mngr, state)
    resumed_ddp = make()
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    ms_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), ms)
    resumed = ckpt.restore(mngr, resumed_ddp.abstract_state(like, ms_like))
    assert int(resumed.step) == 6 and spec.kind(6) == "local"
    for b in batches[6:]:
        resumed, _ = resumed_ddp.step(resumed, b)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_options_that_do_not_combine_are_named():
    with pytest.raises(ValueError, match="does not combine with accumulate_steps > 1"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), accumulate_steps=2,
                          local_sgd=jddp.local_sgd.post_local_sgd(4))
    with pytest.raises(TypeError, match=r"call it: jddp\.local_sgd\.diloco\(period=\.\.\.\)"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), local_sgd=jddp.local_sgd.diloco)
    with pytest.raises(ValueError, match="period must be an int >= 1"):
        jddp.local_sgd.post_local_sgd(0)
    with pytest.raises(ValueError, match="DiLoCo starts from the given parameters"):
        jddp.local_sgd.LocalSGD(4, 10, optax.sgd(0.7))
    with pytest.raises(TypeError, match="outer_optimizer must be an optax"):
        jddp.local_sgd.diloco(4, outer_optimizer="nesterov")


def test_nnx_front_end_refuses_local_sgd():
    from flax import nnx

    model = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="does not take local_sgd yet"):
        jddp.nnx.DataParallel(model, optax.sgd(0.1), loss_fn=lambda m, b: jnp.mean(m(b["x"])),
                              local_sgd=jddp.local_sgd.diloco(4))
