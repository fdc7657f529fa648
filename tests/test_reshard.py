"""ZeRO-3 resharding (``reshard_after_forward``) whatever the loss does to its parameters: casts
(the in-loss bfloat16 recipe), transposes, NNX's own dtype promotion under a bf16 policy. Each
value computed from parameters alone is recomputed from the leaves gathered again in the
backward, so the compiled program re-gathers there and its peak memory does not grow with the
cast; what cannot be recomputed is warned about and listed in ``BucketPlan.not_resharded``.

Tolerances: float32 parameters after 3 Adam steps. A bfloat16 loss on 8 devices against the
one-device reference doing the same casts on 8 shards of the batch (tests/_reference.py
``shards=8``): summation order only, 1e-5 (measured ~1e-7).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp.perf import schedule
from tests import _reference as ref

N = 8


def _mlp(layers, width, cast, seed=0):
    """``layers`` square tanh layers; ``cast``: the loss casts every parameter (and the input)
    to bfloat16 at its top, docs/migration.md's recipe."""
    rng = np.random.default_rng(seed)
    params = {f"l{i:02d}": {"w": jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width),
                                             jnp.float32),
                            "b": jnp.asarray(0.1 * rng.standard_normal(width), jnp.float32)}
              for i in range(layers)}

    def loss(p, b):
        h = b["x"]
        if cast:
            p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
            h = h.astype(jnp.bfloat16)
        for i in range(layers):
            h = jnp.tanh(h @ p[f"l{i:02d}"]["w"] + p[f"l{i:02d}"]["b"])
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2)

    batch = {"x": jnp.asarray(rng.standard_normal((32, width)), jnp.float32),
             "y": jnp.asarray(rng.standard_normal((32, width)), jnp.float32)}
    mb = width * (width + 1) * 4 / 2**20  # one layer per bucket
    return params, loss, batch, jddp.Buckets(cap_mb=mb, first_mb=mb)


def _compiled(ddp, params, batch):
    state = ddp.init(params)
    return ddp.step.lower(state, batch).compile()


def _peak(compiled):
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def _gathers(compiled):
    return sum(c.kind == "all-gather" for c in schedule.collectives(compiled.as_text()))


def test_cast_in_the_loss_keeps_resharding():
    """The issue's case: 12 layers of width 384, one per bucket, stage 3 with resharding. With
    every parameter cast to bfloat16 at the top of the loss the compiled step gathers each
    layer's kernel again in the backward, as without the cast (12 forward + 11 backward: the
    first kernel's gradient needs only the input), and its peak per device is within 5% of the
    peak without the cast and below the peak that keeps the gathered layers
    (reshard_after_forward=False). Before the fix: 12 gathers, 11.8 MiB against 6.9."""
    peaks, gathers, plans = {}, {}, {}
    for name, cast, reshard in [("f32", False, True), ("cast", True, True),
                                ("cast_keep", True, False)]:
        params, loss, batch, caps = _mlp(12, 384, cast)
        ddp = jddp.DataParallel(loss, optax.adam(1e-3),
                                place=jddp.ZeRO(stage=3, reshard_after_forward=reshard),
                                donate=False, reduce=caps)
        compiled = _compiled(ddp, params, batch)
        peaks[name], gathers[name], plans[name] = _peak(compiled), _gathers(compiled), \
            ddp.bucket_plan
        assert ddp.bucket_plan.num_buckets == 12
    assert gathers == {"f32": 23, "cast": 23, "cast_keep": 12}, gathers
    assert peaks["cast"] <= 1.05 * peaks["f32"], peaks
    assert peaks["cast"] < 0.75 * peaks["cast_keep"], peaks
    assert all(plan.not_resharded == () for plan in plans.values())


def test_cast_at_the_top_keeps_the_use_order():
    """Casting every parameter at the top of the loss is not their first use: with Flax's names
    (``Dense_10`` sorts before ``Dense_2``) the bucket plan follows the layers' use order, the
    same plan as without the cast (before: the casts' order, i.e. the sorted keys), at stage 0
    as at stage 3."""
    rng = np.random.default_rng(4)
    params = {f"Dense_{i}": {"kernel": jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32),
                             "bias": jnp.zeros((32,), jnp.float32)} for i in range(12)}

    def loss(cast):
        def fn(p, b):
            h = b["x"]
            if cast:
                p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
                h = h.astype(jnp.bfloat16)
            for i in range(12):
                h = jnp.tanh(h @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"])
            return jnp.mean(h.astype(jnp.float32) ** 2)
        return fn

    batch = {"x": jnp.ones((16, 32), jnp.float32)}
    caps = dict(cap_mb=32 * 33 * 4 / 2**20, first_mb=32 * 33 * 4 / 2**20)
    for stage in (0, 3):
        plans = [jddp.DataParallel(loss(cast), optax.sgd(0.1), reduce=jddp.Buckets(**caps),
                                   place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
                 .plan(params, batch) for cast in (False, True)]
        order = [sorted(b.paths) for b in plans[1].buckets]
        assert order == [sorted(b.paths) for b in plans[0].buckets]
        assert order[0] == ["Dense_11.bias", "Dense_11.kernel"] and len(order) == 12


@pytest.mark.parametrize("use", ["transpose", "reshape", "cast_twice", "tanh", "l2"])
def test_values_computed_from_a_kernel_are_regathered(use):
    """A kernel read through a transpose, a reshape, or two casts (bf16 and back): each layer's
    kernel but the first is gathered again in the backward (3 + 2 gathers for 3 layers); through
    a nonlinear function (tanh, whose VJP reads the kernel) or with an L2 penalty on every kernel
    added to the loss, the first one too (3 + 3). The step trains like stage 0 (1e-5), and
    nothing is reported as kept whole."""
    width = 64
    rng = np.random.default_rng(1)
    params = {f"l{i}": jnp.asarray(rng.standard_normal((width, width)) / 8, jnp.float32)
              for i in range(3)}
    read = {"transpose": lambda w: w.T.T,
            "reshape": lambda w: w.reshape(-1).reshape(width, width),
            "cast_twice": lambda w: w.astype(jnp.bfloat16).astype(jnp.float32),
            "tanh": jnp.tanh, "l2": lambda w: w}[use]

    def loss(p, b):
        h = b["x"]
        for i in range(3):
            h = jnp.tanh(h @ read(p[f"l{i}"]))
        penalty = sum(jnp.sum(w**2) for w in p.values()) if use == "l2" else 0.0
        return jnp.mean((h - b["y"]) ** 2) + 1e-3 * penalty

    batch = {"x": jnp.asarray(rng.standard_normal((16, width)), jnp.float32),
             "y": jnp.asarray(rng.standard_normal((16, width)), jnp.float32)}
    caps = dict(cap_mb=0.015, first_mb=0.015)
    out = {}
    for stage in (0, 3):
        ddp = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(**caps),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                                donate=False)
        state = ddp.init(params)
        if stage == 3:
            again = 3 if use in ("tanh", "l2") else 2
            assert _gathers(ddp.step.lower(state, batch).compile()) == 3 + again
            assert getattr(ddp.bucket_plan, "not_resharded", None) == ()
        for _ in range(3):
            state, _ = ddp.step(state, batch)
        out[stage] = jax.tree.map(np.asarray, ddp.global_params(state))
    assert ref.max_abs_diff(out[3], out[0]) < 1e-5  # Adam: float32 summation order


@pytest.mark.parametrize("reshard", [True, 4], ids=["reshard", "hpz4"])
def test_cast_in_the_loss_equals_the_reference(reshard):
    """docs/migration.md's bf16 recipe at stage 3 with resharding (and hpZ's group of 4): 3 Adam
    steps equal the one-device reference doing the same casts on 8 shards (1e-5), and the
    compiled step gathers each kernel but the first again in the backward."""
    params, loss, batch, _ = _mlp(4, 64, cast=True, seed=2)
    caps = dict(cap_mb=0.02, first_mb=0.02)
    ddp = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(**caps),
                            place=jddp.ZeRO(stage=3, reshard_after_forward=reshard), donate=False)
    state = ddp.init(params)
    compiled = ddp.step.lower(state, batch).compile()
    # One forward gather per bucket, and every kernel but the first's again in the backward.
    assert _gathers(compiled) == ddp.bucket_plan.num_buckets + 3
    for _ in range(3):
        state, metrics = ddp.step(state, batch)
    want = ref.train(loss, optax.adam(1e-2), params, [[batch]] * 3, shards=N)
    assert ref.max_abs_diff(jax.device_get(ddp.global_params(state)), want.params) < 1e-5
    assert float(metrics["loss"]) == pytest.approx(want.losses[-1], rel=1e-4)


def test_what_cannot_be_resharded_is_warned_and_planned():
    """A kernel scaled by a traced scalar (``h @ (w * s)``: the product, as large as the kernel,
    is what the backward reads) cannot be resharded: the trace warns, naming the leaf, the
    operation and the fix, and ``bucket_plan.not_resharded`` lists it; the other layers (a
    cast, a plain use) are resharded and not listed, and the step still equals stage 0."""
    width = 64
    rng = np.random.default_rng(3)
    params = {f"l{i}": {"w": jnp.asarray(rng.standard_normal((width, width)) / 8, jnp.float32)}
              for i in range(3)}

    def loss(p, b):
        h = b["x"] @ (p["l0"]["w"] * jnp.mean(b["s"]))
        h = jnp.tanh(h) @ p["l1"]["w"].astype(jnp.bfloat16).astype(jnp.float32)
        return jnp.mean((jnp.tanh(h) @ p["l2"]["w"]) ** 2)

    batch = {"x": jnp.asarray(rng.standard_normal((16, width)), jnp.float32),
             "s": jnp.full((16,), 0.5, jnp.float32)}
    caps = dict(cap_mb=0.015, first_mb=0.015)
    ddp = jddp.DataParallel(loss, optax.sgd(0.1), reduce=jddp.Buckets(**caps),
                            place=jddp.ZeRO(stage=3), donate=False)
    state = ddp.init(params)
    with pytest.warns(UserWarning, match=r"reshard_after_forward: 1 parameter leaves .*l0\.w "
                                         r"\(read by mul with a traced scalar\).*\(h @ w\) \* s"):
        state, _ = ddp.step(state, batch)
    plan = ddp.bucket_plan
    assert [plan.paths[i] for i in plan.not_resharded] == ["l0.w"]
    assert "NOT resharded" in plan.table() and "l0.w" in plan.table()
    base = jddp.DataParallel(loss, optax.sgd(0.1), donate=False, reduce=jddp.Buckets(**caps))
    bstate, _ = base.step(base.init(params), batch)
    assert base.bucket_plan.not_resharded == ()  # stage 0: nothing to reshard
    assert ref.max_abs_diff(jax.device_get(ddp.global_params(state)),
                            jax.device_get(bstate.params)) < 1e-6
    keep = jddp.DataParallel(loss, optax.sgd(0.1), reduce=jddp.Buckets(**caps),
                             place=jddp.ZeRO(stage=3, reshard_after_forward=False), donate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # keeping every gathered copy is what was asked for
        keep.step(keep.init(params), batch)
    assert keep.bucket_plan.not_resharded == ()


# ---------------------------------------------------------------------- NNX under a bf16 policy

V, D, T = 128, 64, 8


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0]))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class _LM(nnx.Module):
    """A 2-block transformer LM whose layers keep ``dtype=None`` (NNX's promotion rule)."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([_Block(rngs) for _ in range(2)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _lm_loss(model, batch):
    logits = model(batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _lm_batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.integers(0, V, (16, T)).astype(np.int32),
            "y": rng.integers(0, V, (16, T)).astype(np.int32)}


LM_CAPS = dict(cap_mb=0.05, first_mb=0.05)


def test_nnx_bf16_policy_lm_regathers_like_float32():
    """The issue's NNX case: a 2-block LM with ``dtype=None`` layers under
    ``MixedPrecision(bf16)`` at stage 3 compiles as many all-gathers as the same LM without a
    policy (each bucket's forward gather and the backward's again; before the fix 7 against
    20: one per bucket, nothing gathered in backward), nothing is listed as kept whole, and its
    peak is below the same policy's with reshard_after_forward=False."""
    from jddp.precision import MixedPrecision

    batch = _lm_batch()
    gathers, peaks, plans = {}, {}, {}
    for name, policy, reshard in [("f32", None, True), ("bf16", MixedPrecision(), True),
                                  ("bf16_keep", MixedPrecision(), False)]:
        ddp = jddp.nnx.DataParallel(_LM(nnx.Rngs(0)), optax.adam(1e-3), loss_fn=_lm_loss,
                                    reduce=jddp.Buckets(**LM_CAPS),
                                    place=jddp.ZeRO(stage=3, reshard_after_forward=reshard),
                                    precision=policy, donate=False)
        state = ddp.init()
        compiled = ddp.step.lower(state, batch).compile()
        gathers[name], peaks[name] = _gathers(compiled), _peak(compiled)
        k, plans[name] = ddp.bucket_plan.num_buckets, ddp.bucket_plan
    assert k >= 6, k
    assert gathers["bf16"] == gathers["f32"] >= 2 * k, gathers
    assert gathers["bf16_keep"] == k, gathers
    assert peaks["bf16"] < peaks["bf16_keep"], peaks
    assert all(plan.not_resharded == () for plan in plans.values())


def test_nnx_bf16_policy_lm_equals_the_reference():
    """The same LM trained 3 SGD steps under the bf16 policy at stage 3 with resharding equals
    stage 0 under the same policy (2e-5: bfloat16 roundings of the two programs' fusions;
    measured 6e-6), and both equal the one-device reference doing the same casts on 8 shards
    (``jddp.nnx.wrap``'s pure loss) to 1e-4 (measured 3.5e-5 for both stages; float32 training
    is 1e-4 away). SGD: its update is proportional to the gradient (Adam's normalisation turns
    bfloat16 roundings of near-zero gradients into updates of up to 2 x lr)."""
    from jddp.precision import MixedPrecision

    batches = [_lm_batch(s) for s in range(3)]
    out = {}
    for stage in (0, 3):
        ddp = jddp.nnx.DataParallel(_LM(nnx.Rngs(0)), optax.sgd(0.1), loss_fn=_lm_loss,
                                    reduce=jddp.Buckets(**LM_CAPS),
                                    place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                                    precision=MixedPrecision(), donate=False)
        state = ddp.init()
        for b in batches:
            state, metrics = ddp.step(state, b)
        out[stage] = jax.device_get(ddp.core.global_params(state))
    pure, params, _ = jddp.nnx.wrap(_LM(nnx.Rngs(0)), _lm_loss)
    want = ref.train(pure, optax.sgd(0.1), params, [[b] for b in batches],
                     param_dtype=jnp.bfloat16, shards=N)
    assert ref.max_abs_diff(out[3], out[0]) < 2e-5
    assert ref.max_abs_diff(out[3], want.params) < 1e-4
    assert ref.max_abs_diff(out[0], want.params) < 1e-4
    assert float(metrics["loss"]) == pytest.approx(want.losses[-1], rel=1e-3)
