"""Sharded data parallelism (place=jddp.ZeRO(stage=1|2|3)): the same training as stage 0 for any optax
transformation, the collectives of each stage in the compiled step, and the memory they save.

Tolerances (float32, 5 steps): parameters within 1e-5 relative (plus 1e-7 absolute) of stage 0
and of one device on the whole batch; stage 1 is bit-identical to stage 0 on CPU (same all-reduce,
same update arithmetic on slices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.core import collectives, zero
from jddp.perf import schedule, topologies
from jddp.perf.traffic import sent_per_device
from tests._models import layer_list_like, layer_list_loss, mlp_loss, mlp_params, regression_batch

# A layer whose output size (3) no device count divides: its bias stays whole on every device.
SIZES = [8, 32, 24, 3]
CAPS = dict(cap_mb=0.002, first_mb=0.001)
SMALL_CAPS = dict(cap_mb=0.001, first_mb=0.0002)  # one layer per bucket
N = 8


def _batches(n, seed=0, size=32):
    return [regression_batch(seed + i, size, SIZES[0], SIZES[-1]) for i in range(n)]


def _weight_decay_mask(params):
    # adamw's mask by parameter path: no decay on biases.
    return jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key != "bias", params)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw_masked": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=_weight_decay_mask),
    "clip_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-1),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "schedule": lambda: optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.2, 2, 5)),
}


def _train(ddp, params, batches, model_state=None):
    state = ddp.init(params) if model_state is None else ddp.init(params, model_state)
    losses = []
    for b in batches:
        state, metrics = ddp.step(state, b)
        losses.append(float(metrics["loss"]))
        if not ddp.config.place.splits_params:
            ddp.verify(state)  # parameters bit-identical across replicas after every step
    return state, losses


def _single_device(opt, params, batches):
    device = jax.devices()[0]

    @jax.jit
    def step(p, o, b):
        loss, g = jax.value_and_grad(mlp_loss)(p, b)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    p = jax.device_put(params, device)
    o = opt.init(p)
    losses = []
    for b in batches:
        p, o, loss = step(p, o, jax.device_put(b, device))
        losses.append(float(loss))
    return p, losses


def _close(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_stage_trains_like_stage_0_and_one_device(name):
    params, batches = mlp_params(1, SIZES), _batches(5)
    ref_params, ref_losses = _single_device(OPTIMIZERS[name](), params, batches)
    results = {}
    for stage in (0, 1, 2, 3):
        ddp = jddp.DataParallel(mlp_loss, OPTIMIZERS[name](), reduce=jddp.Buckets(**CAPS),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
        state, losses = _train(ddp, params, batches)
        assert ddp.bucket_plan.num_buckets > 1
        results[stage] = (jax.tree.map(np.asarray, state.params), losses)
    for stage in (1, 2, 3):
        _close(results[stage][0], results[0][0])
        np.testing.assert_allclose(results[stage][1], results[0][1], rtol=1e-5)
    _close(results[3][0], ref_params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[3][1], ref_losses, rtol=1e-5)
    if name == "sgd":  # stage 1: the same all-reduce and the same update, on slices
        for x, y in zip(jax.tree.leaves(results[1][0]), jax.tree.leaves(results[0][0]),
                        strict=True):
            np.testing.assert_array_equal(x, y)


def _collectives(ddp, state, batch, **call):
    text = ddp.step.lower(state, batch, **call).compile().as_text()
    found: dict = {}
    for c in schedule.collectives(text):
        found.setdefault(c.kind, []).append(c)
    return found


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_collectives_of_each_stage_in_the_compiled_step(stage):
    """0: one all-reduce per bucket. 1: the same, and one all-gather per bucket of the updated
    pieces. 2: one reduce-scatter per bucket instead of the all-reduce, no all-reduce at all.
    3 (reshard_after_forward=False): one reduce-scatter and one all-gather per bucket (the
    forward's), none in a loop. (Resharding's backward gathers: test_reshard_after_forward.)"""
    params = mlp_params(2, SIZES)
    keep = dict(reshard_after_forward=False) if stage == 3 else {}
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(**SMALL_CAPS),
                            place=jddp.ZeRO(stage=stage, **keep) if stage else jddp.Replicate())
    found = _collectives(ddp, ddp.init(params), _batches(1)[0])
    plan = ddp.bucket_plan
    k = plan.num_buckets
    assert k >= 3
    expected = {
        0: {"all-reduce": k},
        1: {"all-reduce": k, "all-gather": k},
        2: {"reduce-scatter": k, "all-gather": k},
        3: {"reduce-scatter": k, "all-gather": k},
    }[stage]
    assert {kind: len(v) for kind, v in found.items()} == expected
    assert not any(c.in_loop or c.in_conditional for v in found.values() for c in v)
    if stage >= 2:
        # In bucket order, each with its bucket's bytes: split leaves once, whole leaves (and the
        # f32 loss, on the last) as one row per device.
        dims = [zero.shard_dim(s, N) for s in plan.shapes]
        for i, (rs, b) in enumerate(zip(found["reduce-scatter"], plan.buckets, strict=True)):
            want = sum(plan.dtypes[j].itemsize * int(np.prod(plan.shapes[j]))
                       * (N if dims[j] is None else 1) for j in b.indices)
            if i == k - 1:
                want += 4 * N
            assert rs.nbytes == want, (i, rs.nbytes, want)
        assert [c.index for c in found["reduce-scatter"]] == sorted(
            c.index for c in found["reduce-scatter"]
        )


def test_accumulation_collectives_at_stage_2_and_3():
    """With the per-device accumulator (``shard_accumulator=False``) no-sync calls reduce nothing
    (stage 3 still gathers the parameters it computes with); the synchronising call
    reduce-scatters each bucket once for the whole window. (The sharded accumulator's:
    tests/test_shard_accumulator.py.)"""
    params, batch = mlp_params(3, SIZES), _batches(1)[0]
    for stage in (2, 3):
        ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(**SMALL_CAPS),
                                accumulate=jddp.Accumulate(steps=2, shard=False),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
        state = ddp.init(params)
        quiet = _collectives(ddp, state, batch, sync=False)
        loud = _collectives(ddp, state, batch, sync=True)
        k = ddp.bucket_plan.num_buckets
        assert "reduce-scatter" not in quiet and "all-reduce" not in quiet
        assert len(quiet.get("all-gather", [])) == (k if stage == 3 else 0)
        assert len(loud["reduce-scatter"]) == k and "all-reduce" not in loud


def _per_device_bytes(tree):
    """Bytes of ``tree`` held on device 0 (its shard of each array)."""
    total = 0
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            if shard.device == jax.devices()[0]:
                total += shard.data.nbytes
    return total


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_at_rest_per_device(stage):
    """Adam: 3P at stage 0, P + 2P/N at stages 1-2, 3P/N at stage 3 (+1% for leaves kept whole)."""
    params = mlp_params(4, [8, 64, 64, 64, 8])  # every leaf divisible by 8
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2),
                            place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
    state = ddp.init(params)
    p = sum(x.nbytes for x in jax.tree.leaves(params))
    held = _per_device_bytes((state.params, state.opt_state))
    bound = {0: 3 * p, 1: p + 2 * p / N, 2: p + 2 * p / N, 3: 3 * p / N}[stage]
    assert held <= bound * 1.01 + 64, (held, bound)  # 64: Adam's step counter
    if stage:
        assert held < 3 * p * 0.5


def test_hooks_at_sharded_stages():
    params, batches = mlp_params(5, SIZES), _batches(3)
    for hook in (jddp.bf16_compress(), jddp.fp16_compress()):
        ref = None
        for stage in (0, 2, 3):
            ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                                    reduce=jddp.Buckets(hook=hook, **CAPS),
                                    place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
            state, _ = _train(ddp, params, batches)
            got = jax.tree.map(np.asarray, state.params)
            if ref is None:
                ref = got
            else:  # the same compression of the same sums: close at half precision
                _close(got, ref, rtol=1e-2, atol=1e-3)


def _loss_with_aux(params, batch):
    loss = mlp_loss(params, batch)
    return loss, {"norm": jnp.mean(batch["x"] ** 2) + 1e-3 * loss}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_metrics_are_exact_with_compressed_hooks(stage):
    """The loss and aux metrics never ride on a compressed collective: with bf16/fp16 hooks they
    equal the single-device values to 1e-6 relative at every stage (rounded to 16 bits they
    would be off by ~1e-3)."""
    params, batch = mlp_params(6, SIZES), _batches(1, seed=6)[0]
    ref_loss, ref_aux = _loss_with_aux(params, batch)
    for hook in (jddp.bf16_compress(), jddp.fp16_compress()):
        ddp = jddp.DataParallel(_loss_with_aux, optax.sgd(0.1),
                                reduce=jddp.Buckets(hook=hook, **CAPS),
                                loss=jddp.Loss(has_aux=True),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
        _, m = ddp.step(ddp.init(params), batch)
        assert float(m["loss"]) == pytest.approx(float(ref_loss), rel=1e-6)
        assert float(m["norm"]) == pytest.approx(float(ref_aux["norm"]), rel=1e-6)


def _train_hook_state(ddp, params, batches):
    state = ddp.init(params)
    for b in batches:
        state, m = ddp.step(state, b)
    return state, float(m["loss"])


@pytest.mark.parametrize("stage", [2, 3])
def test_powersgd_at_sharded_stages_equals_stage_0(stage):
    """PowerSGD (error feedback, warm start) at stages 2 and 3 is PowerSGD at stage 0: 4 Adam
    steps, 2 of them compressed, give the same parameters and per-device hook state to float32
    tolerance (the hook reduces each bucket with its state as at stage 0; each device keeps its
    piece of the mean)."""
    params, batches = mlp_params(7, SIZES), _batches(4, seed=7)
    results = {}
    for s in (0, stage):
        ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2),
                                reduce=jddp.Buckets(hook=jddp.powersgd(rank=1, start_iter=2),
                                                    **CAPS),
                                place=jddp.ZeRO(stage=s) if s else jddp.Replicate())
        results[s] = _train_hook_state(ddp, params, batches)
    ref, got = results[0][0], results[stage][0]
    _close(jax.tree.map(np.asarray, got.params), ref.params, rtol=1e-5, atol=1e-6)
    _close(got.reduce_state, ref.reduce_state, rtol=1e-5, atol=1e-6)
    residuals = [np.asarray(s["residual"]) for s in got.reduce_state if s]
    assert residuals and max(np.abs(r).max() for r in residuals) > 1e-4  # compression ran
    assert results[stage][1] == pytest.approx(results[0][1], rel=1e-6)


def _hlo_bytes(text):
    """Bytes one device sends for a compiled program's collectives (ring model)."""
    return sum(sent_per_device(c.kind, c.nbytes, len(c.groups[0]) if c.groups else N)
               for c in schedule.collectives(text))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_bytes_equal_the_compiled_collectives(stage):
    """``comm_bytes`` of a synchronising and of a no-sync (accumulating) call equals the ring
    bytes of the collectives in the compiled CPU program, for the plain and the PowerSGD hook
    (compressed phase); bf16 in test_comm_bytes_of_bf16_equal_the_compiled_gpu_collectives. At
    stages 2-3 the plain hook accumulates into the sharded accumulator (a no-sync call
    reduce-scatters), PowerSGD into the per-device one."""
    params, batch = mlp_params(8, SIZES), _batches(1, seed=8)[0]
    sent = {}
    for name, hook in (("none", None), ("powersgd", jddp.powersgd(start_iter=0))):
        ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(hook=hook, **CAPS),
                                accumulate=jddp.Accumulate(steps=2),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                                donate=False)
        state = ddp.init(params)
        for sync in (False, True):
            compiled = ddp.step.lower(state, batch, sync=sync).compile()
            _, m = compiled(state, batch, None, None)
            sent[name, sync] = float(m["comm_bytes"])
            assert sent[name, sync] == pytest.approx(_hlo_bytes(compiled.as_text()), rel=1e-6), (
                name, sync)
    # Stage 3 gathers to compute locally; stages 2-3 reduce-scatter into the sharded accumulator.
    assert (sent["none", False] > 0) == (stage >= 2)
    assert (sent["powersgd", False] > 0) == (stage == 3)
    assert sent["powersgd", True] < sent["none", True]
    if stage == 3:  # scanned micro-batches: the whole parameters gathered once more
        ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS),
                                accumulate=jddp.Accumulate(microbatches=2),
                                place=jddp.ZeRO(stage=3), donate=False)
        state = ddp.init(params)
        compiled = ddp.step.lower(state, batch).compile()
        _, m = compiled(state, batch, None, None)
        assert float(m["comm_bytes"]) > sent["none", True]
        assert float(m["comm_bytes"]) == pytest.approx(_hlo_bytes(compiled.as_text()), rel=1e-6)


@pytest.mark.parametrize("reshard", [True, False])
def test_stage_3_gathers_are_counted_once_under_remat(reshard):
    """Stage 3's gathers are recorded as they are issued (forward, backward re-gathers): a loss
    whose layers are rematerialised (``jax.checkpoint``), traced again for its backward, still
    counts each gather the compiled program runs once, no more."""
    params, batch = mlp_params(8, SIZES), _batches(1, seed=8)[0]

    def layer(p, x):
        return jnp.tanh(x @ p["kernel"] + p["bias"])

    def loss(p, b):
        x = b["x"]
        for i in range(len(p) - 1):
            x = jax.checkpoint(layer)(p[f"Dense_{i}"], x)
        last = p[f"Dense_{len(p) - 1}"]
        return jnp.mean((x @ last["kernel"] + last["bias"] - b["y"]) ** 2)

    ddp = jddp.DataParallel(loss, optax.sgd(0.1), reduce=jddp.Buckets(**CAPS), donate=False,
                            place=jddp.ZeRO(stage=3, reshard_after_forward=reshard))
    state = ddp.init(params)
    compiled = ddp.step.lower(state, batch).compile()
    _, m = compiled(state, batch, None, None)
    text = compiled.as_text()
    assert any(c.kind == "all-gather" for c in schedule.collectives(text))
    assert float(m["comm_bytes"]) == pytest.approx(_hlo_bytes(text), rel=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(not topologies.has_gpu_compiler(), reason="no CUDA compiler plugin")
def test_comm_bytes_of_bf16_equal_the_compiled_gpu_collectives(monkeypatch):
    """With ``bf16_compress()`` ``comm_bytes`` counts the gradients at 2 bytes and the exact
    float32 metrics on their own all-reduce: equal to the collectives of the step compiled for 8
    H100s (compile-only) at every stage. (XLA:CPU promotes bf16 all-reduces and reduce-scatters
    to float32, so on CPU the wire carries float32; see docs/hooks.md.)"""
    # The CPU step counts what the GPU program sends (on CPU, comm_bytes counts XLA:CPU's
    # float32 wire: tests/test_report.py).
    monkeypatch.setattr(collectives, "WIRE_PLATFORM", "gpu")
    like = layer_list_like(3, 64)
    params = [{k: np.random.default_rng(i).normal(size=v.shape).astype(np.float32)
               for k, v in layer.items()} for i, layer in enumerate(like)]
    batch = {k: np.ones((64, 64), np.float32) for k in ("x", "y")}
    caps = dict(cap_mb=0.02, first_mb=0.01)
    for stage in (0, 1, 2, 3):
        cpu = jddp.DataParallel(layer_list_loss, optax.sgd(0.1),
                                reduce=jddp.Buckets(hook=jddp.bf16_compress(), **caps),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
        _, m = cpu.step(cpu.init(params), batch)
        gpu = jddp.DataParallel(layer_list_loss, optax.sgd(0.1),
                                reduce=jddp.Buckets(hook=jddp.bf16_compress(), **caps),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                                mesh=topologies.gpu_mesh(8))
        text = gpu.lower(like, {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
                                for k, v in batch.items()}).compile().as_text()
        assert cpu.bucket_plan.num_buckets > 1
        assert float(m["comm_bytes"]) == pytest.approx(_hlo_bytes(text), rel=1e-6), stage


@pytest.mark.skipif(not topologies.has_gpu_compiler(), reason="no CUDA compiler plugin")
def test_stage_1_comm_bytes_on_the_gpu_target():
    """XLA:GPU's ``reduce-scatter-creator`` pass rewrites an all-reduce whose result each device
    reads only through its own slice into a reduce-scatter. At stage 1 that is the last bucket's
    (each earlier bucket's result is also read whole by the chain to the next bucket): its split
    leaves become one reduce-scatter, its whole leaves and the loss stay an all-reduce. The
    compiled 8xH100 program (compile-only) then sends ``comm_bytes`` minus half the ring
    all-reduce of those split leaves, and exactly ``comm_bytes`` with the pass disabled
    (``compiler_options={"xla_disable_hlo_passes": "reduce-scatter-creator"}``). XLA:CPU has no
    such pass (test_comm_bytes_equal_the_compiled_collectives)."""
    sizes = [64, 250, 256, 256, 8]  # the first layer's bias (250,) stays whole on 8 devices
    params, batch = mlp_params(0, sizes), regression_batch(0, 32, 64, 8)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    caps = dict(cap_mb=0.1, first_mb=0.1)
    cpu = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(**caps),
                            place=jddp.ZeRO(stage=1))
    _, m = cpu.step(cpu.init(params), batch)
    plan = cpu.bucket_plan
    last = plan.buckets[-1].indices
    split = sum(4 * int(np.prod(plan.shapes[i])) for i in last
                if zero.shard_dim(plan.shapes[i], N) is not None)
    assert plan.num_buckets == 3 and split and any(zero.shard_dim(plan.shapes[i], N) is None
                                                   for i in last)
    texts = {}
    for rewrite in (True, False):
        opts = None if rewrite else {"xla_disable_hlo_passes": "reduce-scatter-creator"}
        gpu = jddp.DataParallel(mlp_loss, optax.adam(1e-2), reduce=jddp.Buckets(**caps),
                                place=jddp.ZeRO(stage=1), compiler_options=opts,
                                mesh=topologies.gpu_mesh(N))
        texts[rewrite] = gpu.lower(*like).compile().as_text()
    found = schedule.collectives(texts[True])
    assert [c.nbytes for c in found if c.kind == "reduce-scatter"] == [split]
    assert sum(c.kind == "all-reduce" for c in found) == plan.num_buckets
    comm = float(m["comm_bytes"])
    saved = sent_per_device("all-reduce", split, N) / 2
    assert _hlo_bytes(texts[True]) == pytest.approx(comm - saved, rel=1e-6)
    assert _hlo_bytes(texts[False]) == pytest.approx(comm, rel=1e-6)


@pytest.mark.parametrize("stage", [4, -1, "3", True, 2.0])
def test_bad_stage_is_named(stage):
    with pytest.raises(ValueError, match="ZeRO.stage must be 1, 2 or 3"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1), place=jddp.ZeRO(stage=stage))


def test_model_state_weighted_unused_and_skipping_at_stage_3():
    """Everything else keeps working: BatchNorm-like model state, weighted masks, a parameter
    without gradient, and skipping a non-finite step."""

    def loss(p, ms, b):
        per_example = jnp.mean((jnp.tanh(b["x"] @ p["w"]) @ p["v"] - b["y"]) ** 2, axis=-1)
        new = {"mean": 0.9 * ms["mean"] + 0.1 * jnp.mean(b["x"], 0), "n": ms["n"] + 1}
        return per_example, new

    rng = np.random.default_rng(6)
    params = {"w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
              "v": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
              "unused": jnp.ones((16,), jnp.float32)}
    ms = {"mean": jnp.zeros(8), "n": jnp.zeros((), jnp.int32)}
    batches = _batches(3, seed=6)
    masks = [rng.random(32) < 0.7 for _ in batches]
    results = {}
    for stage in (0, 3):
        ddp = jddp.DataParallel(loss, optax.adam(1e-2), reduce=jddp.Buckets(**CAPS),
                                loss=jddp.Loss(weighted=True, model_state_sync="mean"),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                                loss_scale=jddp.SkipNotFinite())
        state = ddp.init(params, ms)
        for b, m in zip(batches, masks, strict=True):
            state, metrics = ddp.step(state, b, mask=m)
        bad = {"x": np.full((32, 8), np.nan, np.float32), "y": batches[0]["y"]}
        before = jax.tree.map(np.asarray, state.params)
        state, metrics = ddp.step(state, bad)
        assert float(metrics["skipped"]) == 1.0
        _close(state.params, before, rtol=0, atol=0)
        results[stage] = jax.tree.map(np.asarray, (state.params, state.model_state))
    _close(results[3], results[0])
    assert int(results[3][1]["n"]) == 3 and np.all(results[3][0]["unused"] == 1.0)


def test_nnx_front_end_at_stage_3():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 32, rngs=rngs)
            self.b = nnx.Linear(32, 3, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    def loss(model, b):
        return jnp.mean((model(b["x"]) - b["y"]) ** 2)

    out = {}
    for stage in (0, 3):
        ddp = jddp.nnx.DataParallel(MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn=loss,
                                    reduce=jddp.Buckets(**CAPS),
                                    place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
        state = ddp.init()
        for b in _batches(3, seed=7):
            state, _ = ddp.step(state, b)
        out[stage] = jax.tree.map(np.asarray, state.params)
    _close(out[3], out[0])


def test_a_model_that_fits_only_when_sharded():
    """A per-device memory limit below stage 0's peak (arguments + temporaries of the compiled
    step, per device) and above stage 3's: the model trains at stage 3."""
    params = mlp_params(8, [64, 256, 256, 256, 8])
    batch = regression_batch(8, 64, 64, 8)
    peaks = {}
    for stage in (0, 3):
        ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-3),
                                place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
        ma = ddp.lower(params, batch).compile().memory_analysis()
        peaks[stage] = ma.argument_size_in_bytes + ma.temp_size_in_bytes
    limit = (peaks[0] + peaks[3]) // 2
    assert peaks[3] < limit < peaks[0], peaks
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-3), place=jddp.ZeRO(stage=3))
    state = ddp.init(params)
    losses = []
    for _ in range(3):
        state, metrics = ddp.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]


def _deep(layers=8, width=256, tied=False):
    """An MLP of ``layers`` square layers, one per bucket; ``tied``: the first kernel is used
    again, transposed, by a last layer (a shared embedding's pattern)."""
    rng = np.random.default_rng(3)
    params = {f"l{i}": {"w": jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width),
                                         jnp.float32),
                        "b": jnp.zeros((width,), jnp.float32)} for i in range(layers)}

    def loss(p, b):
        h = b["x"]
        for i in range(layers):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        if tied:
            h = h @ p["l0"]["w"].T
        return jnp.mean((h - b["y"]) ** 2)

    data = {"x": jnp.asarray(rng.standard_normal((32, width)), jnp.float32),
            "y": jnp.asarray(rng.standard_normal((32, width)), jnp.float32)}
    mb = width * (width + 1) * 4 / 2**20
    return params, loss, data, jddp.Buckets(cap_mb=mb, first_mb=mb)


def _peak(ddp, state, batch):
    m = ddp.step.lower(state, batch).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def test_reshard_after_forward_memory_and_bytes():
    """Stage 3's default (reshard_after_forward=True) drops each gathered layer after its forward
    use and gathers it again for the backward: the compiled peak per device is at most 0.6x stage
    2's and 3P/N + 8 buckets + P/4, below the peak that keeps the gathered buckets (False); the
    backward gathers are counted in comm_bytes exactly as the compiled program sends them (the
    first layer's kernel and every bias are not gathered again: their VJPs do not read them)."""
    params, loss, batch, caps = _deep()
    p_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    peaks, sent, gathers = {}, {}, {}
    for name, kw in [("s2", dict(place=jddp.ZeRO(stage=2))),
                     ("keep", dict(place=jddp.ZeRO(stage=3, reshard_after_forward=False))),
                     ("reshard", dict(place=jddp.ZeRO(stage=3)))]:
        ddp = jddp.DataParallel(loss, optax.adam(1e-3), donate=False, reduce=caps, **kw)
        state = ddp.init(params)
        peaks[name] = _peak(ddp, state, batch)
        text = ddp.step.lower(state, batch).compile().as_text()
        gathers[name] = sum(c.kind == "all-gather" for c in schedule.collectives(text))
        sent[name] = (float(ddp.step(state, batch)[1]["comm_bytes"]), _hlo_bytes(text))
    k = 8
    assert peaks["reshard"] <= 0.6 * peaks["s2"], peaks
    assert peaks["reshard"] <= 3 * p_bytes / N + 8 * p_bytes / k + p_bytes / 4, peaks
    assert peaks["reshard"] < peaks["keep"], peaks
    assert gathers["keep"] == k and gathers["reshard"] == k + (k - 1), gathers
    layer = 256 * 256 * 4 * (N - 1) / N
    assert sent["reshard"][0] == pytest.approx(sent["keep"][0] + (k - 1) * layer, abs=1.0)
    for got, compiled in sent.values():
        assert got == pytest.approx(compiled, rel=1e-6)


def test_a_model_that_fits_only_with_resharding():
    """A per-device memory limit between the compiled peaks of stage 3 without and with
    reshard_after_forward (arguments + outputs - aliased + temporaries): only the resharding step
    fits under it, and it trains (the loss falls over 3 Adam steps)."""
    params, loss, batch, caps = _deep()
    peaks, states = {}, {}
    for reshard in (False, True):
        ddp = jddp.DataParallel(loss, optax.adam(1e-3),
                                place=jddp.ZeRO(stage=3, reshard_after_forward=reshard),
                                donate=False, reduce=caps)
        states[reshard] = (ddp, ddp.init(params))
        peaks[reshard] = _peak(ddp, states[reshard][1], batch)
    limit = (peaks[False] + peaks[True]) // 2
    assert peaks[True] < limit < peaks[False], peaks
    ddp, state = states[True]
    losses = []
    for _ in range(3):
        state, metrics = ddp.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("tied", [False, True])
def test_reshard_after_forward_equals_stage_0(tied):
    """3 Adam steps at stage 3 with and without resharding equal stage 0 (1e-6), also when a
    kernel is read twice (tied: each use gathers it again in backward, its gradient is the sum
    of both uses' and is reduce-scattered once, with its bucket)."""
    params, loss, batch, caps = _deep(layers=4, width=64, tied=tied)
    caps = dict(cap_mb=0.02, first_mb=0.02)
    out = {}
    for name, kw in [("s0", dict()),
                     ("keep", dict(place=jddp.ZeRO(stage=3, reshard_after_forward=False))),
                     ("reshard", dict(place=jddp.ZeRO(stage=3, reshard_after_forward=True)))]:
        ddp = jddp.DataParallel(loss, optax.adam(1e-2), donate=False, reduce=jddp.Buckets(**caps),
                                **kw)
        state = ddp.init(params)
        for _ in range(3):
            state, m = ddp.step(state, batch)
        out[name] = (jax.tree.map(np.asarray, state.params), float(m["loss"]))
    for name in ("keep", "reshard"):
        _close(out[name][0], out["s0"][0], rtol=1e-6, atol=1e-6)
        assert out[name][1] == pytest.approx(out["s0"][1], rel=1e-6)


def test_backward_prefetch_equals_stage_0(monkeypatch):
    """The backward prefetch of resharded stage 3 (on where collectives are asynchronous, GPU
    and TPU; tests/test_gpu_step.py checks its schedule) forced on here, on CPU: 3 Adam steps
    still equal stage 0 (1e-6) with a kernel read twice (tied), every kernel but the first is
    gathered again, and the first once more for its tied use (no gather merged by the
    combiner, none dropped), and comm_bytes equals the
    compiled program's collectives."""
    from jddp._src.reduce import regather

    assert not regather.backward_prefetch()  # off on CPU: a prefetch cannot overlap there
    monkeypatch.setattr(regather, "backward_prefetch", lambda: True)
    params, loss, batch, _ = _deep(layers=4, width=64, tied=True)
    caps = dict(cap_mb=0.02, first_mb=0.02)
    out = {}
    for name, kw in [("s0", dict()), ("reshard", dict(place=jddp.ZeRO(stage=3)))]:
        ddp = jddp.DataParallel(loss, optax.adam(1e-2), donate=False, reduce=jddp.Buckets(**caps),
                                **kw)
        state = ddp.init(params)
        text = ddp.step.lower(state, batch).compile().as_text()
        for _ in range(3):
            state, m = ddp.step(state, batch)
        out[name] = (jax.tree.map(np.asarray, state.params), float(m["loss"]))
    _close(out["reshard"][0], out["s0"][0], rtol=1e-6, atol=1e-6)
    assert out["reshard"][1] == pytest.approx(out["s0"][1], rel=1e-6)
    k = ddp.bucket_plan.num_buckets
    # Backward: the kernels of layers 1-3, and l0 again for the tied use (it reads l0 through
    # a transpose, recomputed from the gathered kernel: the transposed kernel is not kept).
    assert sum(c.kind == "all-gather" for c in schedule.collectives(text)) == k + 4
    assert float(m["comm_bytes"]) == pytest.approx(_hlo_bytes(text), rel=1e-6)


def test_reshard_after_forward_option_errors():
    with pytest.raises(ValueError, match=r"jddp\.ZeRO\(stage=3\) only"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                          place=jddp.ZeRO(stage=2, reshard_after_forward=True))
    # An int group size (ZeRO++'s hpZ): tests/test_hpz.py.
    with pytest.raises(TypeError, match="True or False"):
        jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                          place=jddp.ZeRO(stage=3, reshard_after_forward="yes"))
