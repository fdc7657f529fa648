"""The migration guide (docs/migration.md) in code: old train steps and their jddp versions agree.

Each version trains the same Linen MLP with the same optax optimizer on the same random global
batches for STEPS steps. Old versions: ``jax.pmap`` + ``lax.pmean(grads)``, and ``jit`` with
``NamedSharding`` (GSPMD). New versions: ``jddp.value_and_grad`` inside the same ``pmap`` (the
drop-in), and ``jddp.DataParallel``. All are the same mean-gradient step, so float32 params agree to
summation-order noise; we assert rtol/atol 1e-5 after 5 Adam steps.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax import linen as nn
from flax.training import train_state
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jddp

STEPS = 5
TOL = dict(rtol=1e-5, atol=1e-5)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(4)(x)


model = MLP()


def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_data(n_steps=STEPS, size=64, seed=0):
    # Labels from a random linear teacher, so that the loss falls and the runs visibly train.
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(10, 4))
    data = []
    for _ in range(n_steps):
        x = rng.normal(size=(size, 10)).astype(np.float32)
        data.append({"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)})
    return data


def init_params():
    return model.init(jax.random.key(0), jnp.zeros((1, 10)))["params"]


tx = optax.adam(1e-2)


# ---- old: pmap + lax.pmean ---------------------------------------------------------------------

def train_pmap_old(data):
    state = train_state.TrainState.create(apply_fn=model.apply, params=init_params(), tx=tx)
    state = jax_utils.replicate(state)
    n = jax.local_device_count()

    @functools.partial(jax.pmap, axis_name="batch")
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        grads = lax.pmean(grads, axis_name="batch")
        loss = lax.pmean(loss, axis_name="batch")
        return state.apply_gradients(grads=grads), loss

    losses = []
    for batch in data:
        batch = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        state, loss = train_step(state, batch)
        losses.append(float(loss[0]))
    return jax_utils.unreplicate(state).params, losses


# ---- new (drop-in): pmap + jddp.value_and_grad ---------------------------------------------------

def train_pmap_jddp(data):
    state = train_state.TrainState.create(apply_fn=model.apply, params=init_params(), tx=tx)
    state = jax_utils.replicate(state)
    n = jax.local_device_count()

    @functools.partial(jax.pmap, axis_name="batch")
    def train_step(state, batch):
        loss, grads = jddp.value_and_grad(loss_fn, axis_name="batch")(state.params, batch)
        loss = lax.pmean(loss, axis_name="batch")
        return state.apply_gradients(grads=grads), loss

    losses = []
    for batch in data:
        batch = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        state, loss = train_step(state, batch)
        losses.append(float(loss[0]))
    return jax_utils.unreplicate(state).params, losses


# ---- old: jit + NamedSharding --------------------------------------------------------------------

def train_sharded_jit_old(data):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in data:
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


# ---- new: jddp.DataParallel ----------------------------------------------------------------------

def train_data_parallel(data):
    ddp = jddp.DataParallel(loss_fn, tx, mesh=jddp.data_mesh())
    state = ddp.init(init_params())
    losses = []
    for batch in data:
        state, metrics = ddp.step(state, batch)
        losses.append(float(metrics["loss"]))
    return state.params, losses


def assert_trees_close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL), a, b)


def test_all_versions_agree():
    data = make_data()
    results = {
        "pmap_old": train_pmap_old(data),
        "pmap_jddp": train_pmap_jddp(data),
        "sharded_jit_old": train_sharded_jit_old(data),
        "data_parallel": train_data_parallel(data),
    }
    ref_params, ref_losses = results["sharded_jit_old"]
    # The runs actually trained (not a no-op agreement).
    assert ref_losses[-1] < ref_losses[0]
    for name, (params, losses) in results.items():
        np.testing.assert_allclose(losses, ref_losses, **TOL, err_msg=name)
        assert_trees_close(params, ref_params)


def test_value_and_grad_inside_pmap_is_one_mean():
    """Inside pmap, jddp.value_and_grad returns the mean gradient, not N times it."""
    data = make_data(n_steps=1)[0]
    params = init_params()
    n = jax.local_device_count()
    ref = jax.grad(loss_fn)(params, data)
    sharded = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), data)
    grads = jax.pmap(
        lambda p, b: jddp.value_and_grad(loss_fn, axis_name="b", cap_mb=0.01,
                                         first_mb=0.005)(p, b)[1],
        axis_name="b",
    )(jax_utils.replicate(params), sharded)
    for i in range(n):
        assert_trees_close(jax.tree.map(lambda g, i=i: g[i], grads), ref)


# ------------------------------------------------------------------ Part 1: the PyTorch mapping

_DDP_CONCEPTS = (
    "init_process_group", "torchrun", "DistributedSampler", "set_epoch", "DDP(model",
    "bucket_cap_mb", "no_sync", "fp16_compress_hook", "powerSGD_hook", "find_unused_parameters",
    "static_graph", "broadcast_buffers", "SyncBatchNorm", "join", "gradient_as_bucket_view",
    "torch.save", "dist.barrier", "ZeroRedundancyOptimizer", "FSDP", "GradScaler",
    "clip_grad_norm_", "autocast",
)


def _ddp_rows():
    """``(torch, jddp, difference)`` of each row of migration.md's Part 1 table."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "migration.md").read_text()
    part1 = text[text.index("## Part 1"):text.index("## Part 2")]
    rows = [line for line in part1.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[1:]]
    assert all(len(c) == 3 for c in cells), [c for c in cells if len(c) != 3]
    return cells


def test_migration_maps_every_ddp_concept_to_a_jddp_spelling_that_exists():
    """Issue 35: docs/migration.md was not a PyTorch-DDP mapping. Every DDP concept a user brings
    has a row, and every ``jddp.*`` name in its jddp column resolves."""
    import importlib
    import re

    rows = _ddp_rows()
    for concept in _DDP_CONCEPTS:
        assert any(concept in torch for torch, _, _ in rows), f"no row for {concept}"
    names = {m for _, spelled, _ in rows for m in re.findall(r"jddp(?:\.\w+)+", spelled)}
    assert len(names) >= 14
    for name in sorted(names):
        parts = name.split(".")
        obj = importlib.import_module(parts[0])
        for i, attr in enumerate(parts[1:], 1):
            if not hasattr(obj, attr):  # a submodule not imported by its parent
                obj = importlib.import_module(".".join(parts[:i + 1]))
            else:
                obj = getattr(obj, attr)
        assert obj is not None, name


def test_the_keywords_the_mapping_names_are_accepted():
    """The DataParallel keywords of the jddp column, in the policies' spelling, construct a
    trainer without a DeprecationWarning (the column shows the current spelling)."""
    import warnings

    import jddp.precision

    two_level = jddp.data_mesh(hosts=2)
    cases = [
        {"reduce": jddp.Buckets(cap_mb=25)}, {"reduce": jddp.Buckets(cap_mb="model")},
        {"accumulate": jddp.Accumulate(steps=4)}, {"accumulate": jddp.Accumulate(microbatches=2)},
        {"reduce": jddp.Buckets(hook=jddp.fp16_compress())},
        {"reduce": jddp.Buckets(hook=jddp.bf16_compress())},
        {"reduce": jddp.Buckets(hook=jddp.powersgd(rank=1, start_iter=1000,
                                                   min_compression_rate=2.0))},
        {"reduce": jddp.Buckets(keep_unused=True)},
        {"loss": jddp.Loss(model_state_sync="broadcast")}, {"place": jddp.ZeRO(stage=1)},
        {"place": jddp.ZeRO(stage=2)}, {"place": jddp.ZeRO(stage=3, reshard_after_forward=True)},
        {"place": jddp.ZeRO(stage=3, hybrid=True), "mesh": two_level},
        {"reduce": jddp.Buckets(hook=jddp.hooks.hierarchical(inner=jddp.bf16_compress())),
         "mesh": two_level},
        {"reduce": jddp.Buckets(hook=jddp.hooks.int8_compress())},
        {"loss": jddp.Loss(weighted=True)}, {"loss": jddp.Loss(rng=True)},
        {"verify_every": 10},
        {"loss_scale": jddp.precision.DynamicScale()}, {"loss_scale": jddp.SkipNotFinite()},
        {"precision": jddp.precision.MixedPrecision(param_dtype=jnp.bfloat16,
                                                    reduce_dtype=jnp.float32)},
    ]
    for kw in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            jddp.DataParallel(lambda p, b, *rng: jnp.sum(p["w"]), optax.adamw(1e-3), **kw)
