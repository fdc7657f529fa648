"""The combination matrix: options x topology x ZeRO stage x processes, each cell either equal to the
one single-device reference trainer (tests/_reference.py) within a stated tolerance, or refused
with a stated reason.

A cell is one row of ``CELLS``. When a refusal is lifted, edit its row from ``refused(...)`` to
``equal(...)`` (and, for a new reference algorithm, a ``Case`` in ``CASES``). Rows with
``procs=2`` also run on 2 processes x 4 CPU devices over Gloo (one launch for all of them): each
run twice, the repeats bitwise equal, each equal to the 1 x 8 run to float32 tolerance and to the
reference.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.step import compat
from tests import _reference as ref
from tests._models import layers_loss, layers_params, mlp_loss, mlp_params, regression_batch
from tests.launch_util import run_launcher

SIZES = [6, 16, 16, 3]
ROWS = 32  # global batch
CAPS = dict(cap_mb=0.002, first_mb=0.001)
KEY = 11


# ------------------------------------------------------------------------------------- the cases


def _per_example(p, b):
    x = b["x"]
    for i in range(3):
        x = x @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
        x = jnp.tanh(x) if i < 2 else x
    return jnp.mean((x - b["y"]) ** 2, axis=-1)


def _dropout_loss(p, b, keys):
    h = jnp.tanh(b["x"] @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.8, (h.shape[-1],)))(keys)
    h = jnp.where(keep, h / 0.8, 0.0)
    h = jnp.tanh(h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"])
    out = h @ p["Dense_2"]["kernel"] + p["Dense_2"]["bias"]
    return jnp.mean((out - b["y"]) ** 2)


def _stateful_loss(p, ms, b):
    """A loss that reads its model state (a running mean of the first layer's activations, an
    update linear in the batch: ``model_state_sync="mean"`` gives the whole batch's)."""
    h = jnp.tanh(b["x"] @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    new = {"mu": 0.9 * ms["mu"] + 0.1 * jnp.mean(h, 0)}
    return mlp_loss(p, b) + 0.1 * jnp.mean((h - ms["mu"]) ** 2), new


MODEL_STATE = {"mu": np.full((SIZES[1],), 0.1, np.float32)}


def _syncbn_loss(axis):
    """The MLP with a cross-replica BatchNorm after the first layer (statistics ``pmean``ed
    over ``axis``; ``None``: one device, the whole batch's) and its running mean as model state:
    the default plan leaves its scale to JAX (``BucketPlan.implicit``, tests/test_replicated.py)."""
    def loss(p, ms, b):
        h = b["x"] @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
        mean, sq = jnp.mean(h, 0), jnp.mean(h * h, 0)
        if axis is not None:
            mean, sq = jax.lax.pmean((mean, sq), axis)
        h = (h - mean) * (jax.lax.rsqrt(sq - mean**2 + 1e-5) * p["BN"]["scale"]) + p["BN"]["bias"]
        h = jnp.tanh(jnp.tanh(h) @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"])
        out = h @ p["Dense_2"]["kernel"] + p["Dense_2"]["bias"]
        return jnp.mean((out - b["y"]) ** 2), {"mu": 0.9 * ms["mu"] + 0.1 * mean}

    return loss


def _syncbn_params():
    rng = np.random.default_rng(5)
    return {**mlp_params(0, SIZES), "BN": {
        "scale": jnp.asarray(1 + 0.1 * rng.normal(size=SIZES[1]), jnp.float32),
        "bias": jnp.asarray(0.1 * rng.normal(size=SIZES[1]), jnp.float32)}}


def _batches(n, rows=ROWS, seed=0):
    return [regression_batch(100 * seed + i, rows, SIZES[0], SIZES[-1]) for i in range(n)]


def _masks(n):
    return [(np.arange(ROWS) % (3 + i) != 0).astype(np.float32) for i in range(n)]


@dataclass(frozen=True)
class Case:
    """How a cell trains, and its reference: ``calls`` (per call: batch, mask, rng) for
    ``DataParallel.step``, and ``reference(replicas) -> params`` (``replicas``: whether it reads
    the replica count, as local SGD's does; the others are the same on every mesh)."""

    loss: Callable[..., Any]
    calls: Callable[[], list[dict]]
    reference: Callable[[int], Any]
    optimizer: Callable[[], optax.GradientTransformation] = lambda: optax.adam(1e-2)
    model_state: Any = None
    params: Callable[[], Any] = lambda: mlp_params(0, SIZES)
    replicas: bool = False


def _plain_ref(_):
    return ref.train(mlp_loss, optax.adam(1e-2), mlp_params(0, SIZES),
                     [[b] for b in _batches(3)]).params


def _plain_sgd_ref(_):
    return ref.train(mlp_loss, optax.sgd(0.1), mlp_params(0, SIZES),
                     [[b] for b in _batches(3)]).params


def _accumulate_ref(_):
    micro = _batches(4, ROWS // 2)
    return ref.train(mlp_loss, optax.adam(1e-2), mlp_params(0, SIZES),
                     [micro[0:2], micro[2:4]]).params


def _model_state_ref(_):
    return ref.train(_stateful_loss, optax.adam(1e-2), mlp_params(0, SIZES),
                     [[b] for b in _batches(3)], model_state=MODEL_STATE).params


def _syncbn_ref(_):
    return ref.train(_syncbn_loss(None), optax.sgd(0.1), _syncbn_params(),
                     [[b] for b in _batches(3)], model_state=MODEL_STATE).params


def _syncbn_accumulate_ref(_):
    micro = _batches(4, ROWS // 2)
    return ref.train(_syncbn_loss(None), optax.sgd(0.1), _syncbn_params(),
                     [micro[0:2], micro[2:4]], model_state=MODEL_STATE).params


def _masked_ref(_):
    return ref.train(_per_example, optax.adam(1e-2), mlp_params(0, SIZES),
                     [[b] for b in _batches(3)], masks=[[m] for m in _masks(3)],
                     weighted=True).params


def _rng_ref(_):
    return ref.train(_dropout_loss, optax.adam(1e-2), mlp_params(0, SIZES),
                     [[b] for b in _batches(3)], rng_key=jax.random.key(KEY)).params


# Mixed precision: the same casts on one device, each of the 8 devices' shards its own bfloat16
# gradient (reference shards=8), averaged and applied in float32 (measured agreement ~3e-8).
MP = jnp.bfloat16


def _mp_plain_ref(_):
    return ref.train(mlp_loss, optax.adam(1e-2), mlp_params(0, SIZES),
                     [[b] for b in _batches(3)], param_dtype=MP, shards=8).params


def _mp_plain_sgd_ref(_):
    return ref.train(mlp_loss, optax.sgd(0.1), mlp_params(0, SIZES),
                     [[b] for b in _batches(3)], param_dtype=MP, shards=8).params


def _mp_accumulate_ref(_):
    micro = _batches(4, ROWS // 2)
    return ref.train(mlp_loss, optax.adam(1e-2), mlp_params(0, SIZES),
                     [micro[0:2], micro[2:4]], param_dtype=MP, shards=8).params


def _cast_loss(p, b):
    """docs/migration.md's bf16 recipe: every parameter and the input cast to bfloat16 at the top
    of the loss, the loss accumulated in float32 (ZeRO-3 resharding recomputes the casts from
    the leaves it gathers again in the backward: tests/test_reshard.py)."""
    p16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
    out = mlp_loss(p16, {"x": b["x"].astype(jnp.bfloat16), "y": b["y"]})
    return out.astype(jnp.float32)


def _cast_ref(_):
    return ref.train(_cast_loss, optax.adam(1e-2), mlp_params(0, SIZES),
                     [[b] for b in _batches(3)], shards=8).params


def _post_local_ref(replicas):
    return ref.local_sgd(mlp_loss, optax.sgd(0.1), mlp_params(0, SIZES), _batches(3),
                         replicas=replicas, period=2).params


def _diloco_ref(replicas):
    return ref.local_sgd(mlp_loss, optax.adam(1e-2), mlp_params(0, SIZES), _batches(4),
                         replicas=replicas, period=2,
                         outer=optax.sgd(0.7, momentum=0.9, nesterov=True)).params


# Optimizers whose update reduces over every leaf (a global norm, per-leaf trust ratios and
# factored moments): with ZeRO those reductions run over sharded leaves, all-reduces XLA's
# partitioner prints in its mesh form of replica groups.
CLIP = 0.5  # below every step's gradient norm (0.9-1.4 on these batches): each step clips


def _clip_adam():
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adam(1e-2))


def _optimizer_ref(make):
    def reference(_):
        return ref.train(mlp_loss, make(), mlp_params(0, SIZES), [[b] for b in _batches(3)]).params

    return reference


def _clip_muon():
    """Muon (Newton-Schulz on the kernels, AdamW on the biases) after global-norm clipping."""
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.contrib.muon(2e-2))


def _muon_accumulate_ref(_):
    micro = _batches(4, ROWS // 2)
    return ref.train(mlp_loss, _clip_muon(), mlp_params(0, SIZES), [micro[0:2], micro[2:4]]).params


# Owner sharding's balanced path (docs/sharded.md): 16 equal matrices, two per device on 8, with
# their biases, named so that the leaves' order is the layers' (owners 0-7, 0-7 in order), in
# buckets of 8 layers (OWNER_CAPS), so every row of a bucket's reduce-scatter is exactly its
# owner's leaves. Tiny widths: the compile stays small.
MANY, MANY_WIDTH = 16, 8
OWNER_CAPS = dict(cap_mb=0.002, first_mb=0.002)


def _many_params():
    return layers_params(3, MANY, MANY_WIDTH)


_many_loss = layers_loss


def _many_batches(n, rows=ROWS):
    return [regression_batch(200 + i, rows, MANY_WIDTH, MANY_WIDTH) for i in range(n)]


def _muon():
    """Muon without a global norm: at stages 2-3 each owner reads only its own rows."""
    return optax.contrib.muon(2e-2)


def _many_muon_ref(_):
    return ref.train(_many_loss, _muon(), _many_params(), [[b] for b in _many_batches(3)]).params


def _many_muon_accumulate_ref(_):
    micro = _many_batches(4, ROWS // 2)
    return ref.train(_many_loss, _clip_muon(), _many_params(), [micro[0:2], micro[2:4]]).params


CASES = {
    "plain": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(3)], _plain_ref),
    # Lossy hooks: SGD, whose update is proportional to the gradient (Adam's normalisation
    # turns a rounding of a near-zero gradient into an update of up to 2 x lr).
    "plain_sgd": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(3)], _plain_sgd_ref,
                      lambda: optax.sgd(0.1)),
    "accumulate": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(4, ROWS // 2)],
                       _accumulate_ref),
    "model_state": Case(_stateful_loss, lambda: [{"batch": b} for b in _batches(3)],
                        _model_state_ref, model_state=MODEL_STATE),
    # SGD: the first layer's bias has a zero gradient under BatchNorm (the mean subtracts it),
    # which Adam would turn into updates of +-lr from float32 rounding.
    "syncbn": Case(_syncbn_loss("data"), lambda: [{"batch": b} for b in _batches(3)],
                   _syncbn_ref, lambda: optax.sgd(0.1), model_state=MODEL_STATE,
                   params=_syncbn_params),
    "syncbn_accumulate": Case(_syncbn_loss("data"), lambda: [
        {"batch": b} for b in _batches(4, ROWS // 2)], _syncbn_accumulate_ref,
        lambda: optax.sgd(0.1), model_state=MODEL_STATE, params=_syncbn_params),
    "masked": Case(_per_example, lambda: [
        {"batch": b, "mask": m} for b, m in zip(_batches(3), _masks(3), strict=True)], _masked_ref),
    "rng": Case(_dropout_loss, lambda: [{"batch": b, "rng": jax.random.key(KEY)}
                                        for b in _batches(3)], _rng_ref),
    "mp_plain": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(3)], _mp_plain_ref),
    "mp_plain_sgd": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(3)],
                         _mp_plain_sgd_ref, lambda: optax.sgd(0.1)),
    "mp_accumulate": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(4, ROWS // 2)],
                          _mp_accumulate_ref),
    "cast_in_loss": Case(_cast_loss, lambda: [{"batch": b} for b in _batches(3)], _cast_ref),
    "post_local": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(3)], _post_local_ref,
                       lambda: optax.sgd(0.1), replicas=True),
    "diloco": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(4)], _diloco_ref,
                   replicas=True),
    # DiLoCo composed with the step's options, against the same DiLoCo reference: two halves of
    # each batch per window (each device gets the same rows over the window as from the whole
    # batch), all-ones masks, keys the loss does not read, an aux metric to sum. (Masks that drop
    # rows and real per-example keys are checked per island in tests/test_local_sgd.py.)
    "diloco_halves": Case(mlp_loss, lambda: [{"batch": h} for b in _batches(4)
                                             for h in _device_halves(b)], _diloco_ref,
                          replicas=True),
    "diloco_ones_mask": Case(_per_example, lambda: [
        {"batch": b, "mask": np.ones(ROWS, np.float32)} for b in _batches(4)], _diloco_ref,
        replicas=True),
    "diloco_keys": Case(lambda p, b, keys: mlp_loss(p, b), lambda: [
        {"batch": b, "rng": jax.random.key(KEY)} for b in _batches(4)], _diloco_ref,
        replicas=True),
    "diloco_aux": Case(lambda p, b: (mlp_loss(p, b), {"n": jnp.ones(())}),
                       lambda: [{"batch": b} for b in _batches(4)], _diloco_ref, replicas=True),
    "clip": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(3)],
                 _optimizer_ref(_clip_adam), _clip_adam),
    "lamb": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(3)],
                 _optimizer_ref(lambda: optax.lamb(1e-2)), lambda: optax.lamb(1e-2)),
    "adafactor": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(3)],
                      _optimizer_ref(lambda: optax.adafactor(1e-2)),
                      lambda: optax.adafactor(1e-2)),
    "muon": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(3)],
                 _optimizer_ref(_clip_muon), _clip_muon),
    "muon_accumulate": Case(mlp_loss, lambda: [{"batch": b} for b in _batches(4, ROWS // 2)],
                            _muon_accumulate_ref, _clip_muon),
    "many_muon": Case(_many_loss, lambda: [{"batch": b} for b in _many_batches(3)],
                      _many_muon_ref, _muon, params=_many_params),
    "many_muon_accumulate": Case(_many_loss, lambda: [
        {"batch": b} for b in _many_batches(4, ROWS // 2)], _many_muon_accumulate_ref,
        _clip_muon, params=_many_params),
}


def _device_halves(batch, devices=8):
    """Two halves of a global batch: the first and second half of every device's shard."""
    def half(x, h):
        return x.reshape(devices, 2, -1, *x.shape[1:])[:, h].reshape(-1, *x.shape[1:])
    return [jax.tree.map(lambda x, h=h: half(x, h), batch) for h in range(2)]


# ------------------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class Cell:
    """One combination: ``options()`` for ``DataParallel`` (fresh hooks each call), the mesh
    (``"1d"`` or ``"2l"``: hosts x local), the ZeRO stage, the processes it runs on (1, or also
    2), and what is expected: ``("equal", case, tol)`` or ``("refused", regex)``. Cells run
    with the small ``CAPS`` (several buckets) unless ``extra={"default_plan": True}``."""

    name: str
    options: Callable[[], dict]
    topology: str
    stage: int
    expect: tuple
    procs: int = 1
    api: str = "functional"
    extra: dict = field(default_factory=dict)


def equal(case: str, tol: float = 2e-5) -> tuple:
    return ("equal", case, tol)


def refused(reason: str) -> tuple:
    return ("refused", reason)


def refused_by(row: str) -> tuple:
    """Refused by the row ``row`` of jddp's one table of refused combinations (compat)."""
    return ("refused", re.escape(compat.ROWS[row].reason))


# New-spelling keywords: a cell that gives one gets its stage and caps as policies.
POLICY_KEYWORDS = frozenset({"loss", "reduce", "place", "accumulate", "sync", "precision",
                             "loss_scale"})


BF16 = 1e-3  # bf16 on the wire (~3 significant digits of each gradient), SGD(0.1)
INT8 = 2e-3  # int8 blocks of 256 with error feedback, SGD(0.1)


def _mp(**kw):
    return jddp.precision.MixedPrecision(**{"param_dtype": MP, **kw})


def _compat_cells() -> list:
    """One refused cell for each row of the compat table not declared with the old spelling."""
    det = jddp.Deterministic
    shard = lambda: jddp.Accumulate(steps=2, shard=True)
    rows = [
        ("deterministic + ZeRO", lambda: {"reduce": det()}, "1d", 2),
        ("deterministic + local SGD", lambda: {"reduce": det(),
                                               "sync": jddp.local_sgd.post_local_sgd(2)}, "1d", 0),
        ("deterministic + loss scale",
         lambda: {"reduce": det(), "loss_scale": jddp.precision.DynamicScale()}, "1d", 0),
        ("deterministic + mixed precision", lambda: {"reduce": det(), "precision": _mp()}, "1d",
         0),
        ("deterministic + odd accumulation", lambda: {
            "reduce": det(), "accumulate": jddp.Accumulate(steps=3)}, "1d", 0),
        ("deterministic + odd device count", lambda: {"reduce": det()}, "1d6", 0),
        ("hybrid ZeRO on a 1-D mesh", lambda: {"place": jddp.ZeRO(stage=2, hybrid=True)}, "1d",
         2),
        ("sharded accumulator + stage below 2", lambda: {"accumulate": shard()}, "1d", 1),
        ("sharded accumulator + stateful hook", lambda: {
            "accumulate": shard(), "reduce": jddp.Buckets(hook=jddp.powersgd())}, "1d", 2),
        ("offload + local SGD", lambda: {"place": jddp.ZeRO(stage=2, offload=True),
                                         "sync": jddp.local_sgd.diloco(2)}, "2l", 2),
        ("sharded accumulator + local SGD", lambda: {"accumulate": shard(), "sync": jddp.local_sgd.diloco(2)},
         "2l", 2),
    ]
    return [Cell(name, opts, topology, stage, refused_by(name), extra={"row": True})
            for name, opts, topology, stage in rows]


def _cells() -> list[Cell]:
    post = jddp.local_sgd.post_local_sgd
    diloco = jddp.local_sgd.diloco
    c = [
        # hooks x stages, 1-D mesh
        Cell("plain", dict, "1d", 0, equal("plain"), procs=2),
        Cell("plain", dict, "1d", 1, equal("plain")),
        Cell("plain", dict, "1d", 2, equal("plain"), procs=2),
        Cell("plain", dict, "1d", 3, equal("plain")),
        Cell("bf16", lambda: {"hook": jddp.bf16_compress()}, "1d", 0, equal("plain_sgd", BF16)),
        Cell("bf16", lambda: {"hook": jddp.bf16_compress()}, "1d", 2, equal("plain_sgd", BF16)),
        Cell("fp16", lambda: {"hook": jddp.fp16_compress()}, "1d", 3, equal("plain_sgd", BF16)),
        Cell("int8", lambda: {"hook": jddp.hooks.int8_compress()}, "1d", 0,
             equal("plain_sgd", INT8), procs=2),
        Cell("int8 no error feedback (int8 reduce-scatter)",
             lambda: {"hook": jddp.hooks.int8_compress(error_feedback=False)}, "1d", 2,
             equal("plain_sgd", INT8), procs=2),
        Cell("powersgd before start", lambda: {"hook": jddp.powersgd(start_iter=100)}, "1d", 0,
             equal("plain")),
        Cell("powersgd", lambda: {"hook": jddp.powersgd(start_iter=100)}, "1d", 2,
             equal("plain"), procs=2),  # compressed steps at stages 2-3: tests/test_zero.py
        # options x stages
        Cell("accumulate_steps=2", lambda: {"accumulate_steps": 2}, "1d", 0,
             equal("accumulate"), procs=2),
        Cell("accumulate_steps=2", lambda: {"accumulate_steps": 2}, "1d", 2, equal("accumulate")),
        # stages 2-3 accumulate into a sharded accumulator by default; the per-device one:
        Cell("accumulate_steps=2 shard_accumulator=False",
             lambda: {"accumulate_steps": 2, "shard_accumulator": False}, "1d", 3,
             equal("accumulate")),
        Cell("accumulate_steps=2 + hybrid_shard (sharded accumulator)",
             lambda: {"accumulate_steps": 2, "hybrid_shard": True}, "2l", 3,
             equal("accumulate")),
        Cell("microbatches=2", lambda: {"microbatches": 2}, "1d", 0, equal("plain")),
        Cell("weighted + mask", lambda: {"weighted": True}, "1d", 0, equal("masked")),
        Cell("weighted + mask", lambda: {"weighted": True}, "1d", 2, equal("masked")),
        Cell("rng", lambda: {"rng": True}, "1d", 0, equal("rng")),
        Cell("rng", lambda: {"rng": True}, "1d", 3, equal("rng")),
        Cell("skip_not_finite", lambda: {"skip_not_finite": True}, "1d", 1, equal("plain")),
        Cell("model state mean", lambda: {"model_state_sync": "mean"}, "1d", 0,
             equal("model_state")),
        Cell("model state mean", lambda: {"model_state_sync": "mean"}, "2l", 2,
             equal("model_state")),
        # the default plan (no cap given) with a cross-replica BatchNorm: its scale left to
        # JAX where nothing else reads the buckets (stage 0, default hook, every call syncs),
        # in a bucket elsewhere
        Cell("syncbn default plan", dict, "1d", 0, equal("syncbn"), procs=2,
             extra={"default_plan": True}),
        Cell("syncbn default plan + skip_not_finite", lambda: {"skip_not_finite": True}, "1d",
             0, equal("syncbn"), extra={"default_plan": True}),
        Cell("syncbn default plan + loss_scale",
             lambda: {"loss_scale": jddp.precision.DynamicScale()}, "1d", 0, equal("syncbn"),
             extra={"default_plan": True}),
        Cell("syncbn default plan + accumulate_steps=2", lambda: {"accumulate_steps": 2}, "1d",
             0, equal("syncbn_accumulate"), procs=2, extra={"default_plan": True}),
        Cell("syncbn default plan", dict, "1d", 2, equal("syncbn"),
             extra={"default_plan": True}),
        # two-level mesh
        Cell("plain", dict, "2l", 0, equal("plain")),
        Cell("hierarchical", lambda: {"hook": jddp.hooks.hierarchical()}, "2l", 0,
             equal("plain"), procs=2),
        Cell("hierarchical[concat]", lambda: {"hook": jddp.hooks.hierarchical(concat=True)},
             "2l", 0, equal("plain")),
        Cell("hierarchical(inner=bf16)",
             lambda: {"hook": jddp.hooks.hierarchical(inner=jddp.bf16_compress())}, "2l", 0,
             equal("plain_sgd", BF16), procs=2),
        Cell("hierarchical(inner=int8)",
             lambda: {"hook": jddp.hooks.hierarchical(inner=jddp.hooks.int8_compress())}, "2l", 0,
             equal("plain_sgd", INT8)),
        Cell("hierarchical", lambda: {"hook": jddp.hooks.hierarchical()}, "2l", 2,
             equal("plain"), procs=2),
        Cell("hybrid_shard", lambda: {"hybrid_shard": True}, "2l", 2, equal("plain")),
        # ZeRO++ hpZ (reshard_after_forward=k; docs/sharded.md): backward gathers over k devices
        Cell("reshard_after_forward=4 (hpZ)", lambda: {"reshard_after_forward": 4}, "2l", 3,
             equal("plain"), procs=2),
        Cell("reshard_after_forward=2 (hpZ)", lambda: {"reshard_after_forward": 2}, "1d", 3,
             equal("plain")),
        Cell("reshard_after_forward=3", lambda: {"reshard_after_forward": 3}, "1d", 3,
             refused("must divide the 8 devices")),
        # ZeRO-3 resharding x parameters cast in the loss (docs/migration.md's bf16 recipe) and
        # x the bf16 policy with parameters promoted in the loss (bfloat16 kernels meeting
        # float32 inputs: NNX layers at dtype=None); gathers and peaks: tests/test_reshard.py
        Cell("params cast to bf16 in the loss + reshard_after_forward",
             lambda: {"reshard_after_forward": True}, "1d", 3, equal("cast_in_loss"), procs=2),
        Cell("params cast to bf16 in the loss + reshard_after_forward=4 (hpZ)",
             lambda: {"reshard_after_forward": 4}, "2l", 3, equal("cast_in_loss")),
        Cell("mixed_precision, params promoted in the loss + reshard_after_forward",
             lambda: {"mixed_precision": _mp(), "reshard_after_forward": True}, "1d", 3,
             equal("mp_plain"), procs=2),
        # ZeRO-Offload: the optimizer state in host memory between steps (docs/sharded.md)
        Cell("offload", lambda: {"place": jddp.ZeRO(stage=1, offload=True)}, "1d", 1,
             equal("plain")),
        Cell("offload", lambda: {"place": jddp.ZeRO(stage=2, offload=True)}, "1d", 2,
             equal("plain")),
        Cell("offload", lambda: {"place": jddp.ZeRO(stage=3, offload=True)}, "1d", 3,
             equal("plain"), procs=2),
        Cell("offload + accumulate(steps=2)", lambda: {
            "place": jddp.ZeRO(stage=3, offload=True), "accumulate": jddp.Accumulate(steps=2)},
             "1d", 3, equal("accumulate")),
        Cell("offload + hybrid", lambda: {"place": jddp.ZeRO(stage=2, hybrid=True,
                                                             offload=True)}, "2l", 2,
             equal("plain")),
        # local SGD
        Cell("post_local_sgd(2)", lambda: {"local_sgd": post(2)}, "1d", 0, equal("post_local")),
        Cell("diloco(2)", lambda: {"local_sgd": diloco(2)}, "2l", 0, equal("diloco"), procs=2),
        # jddp.nnx with local SGD: tests/test_nnx.py (equal to the functional trainer's DiLoCo).
        # mixed precision (jddp.precision.MixedPrecision; docs/precision.md)
        Cell("mixed_precision", lambda: {"mixed_precision": _mp()}, "1d", 0, equal("mp_plain")),
        Cell("mixed_precision", lambda: {"mixed_precision": _mp()}, "1d", 1, equal("mp_plain")),
        Cell("mixed_precision", lambda: {"mixed_precision": _mp()}, "1d", 2, equal("mp_plain")),
        Cell("mixed_precision", lambda: {"mixed_precision": _mp()}, "1d", 3, equal("mp_plain")),
        Cell("mixed_precision + hybrid_shard", lambda: {"mixed_precision": _mp(),
                                                        "hybrid_shard": True}, "2l", 3,
             equal("mp_plain")),
        Cell("mixed_precision + accumulate_steps=2", lambda: {"mixed_precision": _mp(),
                                                              "accumulate_steps": 2}, "1d", 3,
             equal("mp_accumulate")),
        Cell("mixed_precision + bf16_compress", lambda: {"mixed_precision": _mp(),
                                                         "hook": jddp.bf16_compress()}, "1d", 2,
             equal("mp_plain_sgd", BF16)),
        Cell("mixed_precision(reduce_dtype=bf16)", lambda: {"mixed_precision": _mp(
            reduce_dtype=jnp.bfloat16)}, "1d", 0, equal("mp_plain_sgd", BF16)),
        Cell("mixed_precision(reduce_dtype=bf16) + hook", lambda: {"mixed_precision": _mp(
            reduce_dtype=jnp.bfloat16), "hook": jddp.powersgd()}, "1d", 0,
             refused_by("narrow reduce_dtype + hook"), extra={"row": True}),
        Cell("mixed_precision(float16) without loss_scale", lambda: {"mixed_precision": _mp(
            param_dtype=jnp.float16)}, "1d", 0, refused_by("float16 without loss scaling"),
             extra={"row": True}),
        Cell("diloco + ZeRO on a 1-D mesh", lambda: {"local_sgd": diloco(2)}, "1d", 2,
             refused_by("local SGD + ZeRO on a 1-D mesh"), extra={"row": True}),
        # The other rows of the compat table, in the new spelling (jddp.Deterministic etc.).
        *_compat_cells(),
    ]
    # DiLoCo composed with every option of the step (one island per host, DP/ZeRO inside).
    # Rows with procs=2 also run as one island per process (DP/ZeRO inside, DiLoCo across).
    for label, opts, stage, case, procs in [
        ("accumulate_steps=2", {"accumulate_steps": 2}, 0, "diloco_halves", 2),
        ("microbatches=2", {"microbatches": 2}, 0, "diloco", 1),
        ("weighted", {"weighted": True}, 0, "diloco_ones_mask", 1),
        ("skip_not_finite", {"skip_not_finite": True}, 0, "diloco", 1),
        ("ZeRO(stage=1)", {}, 1, "diloco", 1),
        ("ZeRO(stage=2)", {}, 2, "diloco", 2),
        ("ZeRO(stage=3)", {}, 3, "diloco", 1),
        ("rng", {"rng": True}, 0, "diloco_keys", 1),
        ("sum_metrics", {"sum_metrics": ("n",), "has_aux": True}, 0, "diloco_aux", 1),
        ("loss_scale", {"loss_scale": jddp.precision.DynamicScale()}, 0, "diloco", 1),
    ]:
        c.append(Cell(f"diloco + {label}", lambda o=opts: {"local_sgd": diloco(2), **o}, "2l",
                      stage, equal(case), procs=procs))
    # ZeRO x update rules that reduce over every (sharded) leaf: clipping by the global norm,
    # LAMB, Adafactor, and the step's own global finiteness test (skip_not_finite, loss scaling).
    # The procs=2 rows crashed the program check before (an unread replica-group form).
    for label, case, opts, topology, stages, procs in [
        ("clip_by_global_norm + adam", "clip", {}, "1d", (1, 2, 3), 2),
        ("clip_by_global_norm + adam", "clip", {}, "2l", (2,), 2),
        ("lamb", "lamb", {}, "1d", (1, 2, 3), 1),
        ("adafactor", "adafactor", {}, "1d", (1, 2, 3), 1),
        ("skip_not_finite", "plain", {"skip_not_finite": True}, "1d", (3,), 2),
        ("skip_not_finite", "plain", {"skip_not_finite": True}, "2l", (2,), 2),
        ("loss_scale", "plain", {"loss_scale": jddp.precision.DynamicScale()}, "1d", (1,), 2),
        ("loss_scale", "plain", {"loss_scale": jddp.precision.DynamicScale()}, "2l", (3,), 2),
    ]:
        for stage in stages:
            c.append(Cell(label, lambda o=opts: dict(o), topology, stage, equal(case),
                          procs=procs))
    # Owner sharding (ZeRO(shard="owner"), docs/sharded.md): each leaf updated whole on one
    # device, with Muon after global-norm clipping (whole gradients on every device) and the
    # options around the update. The "16 matrices" rows train two matrices per device in
    # balanced owner rows (checked as they run: _check_owner_route), without a
    # global norm (each owner reads its own rows, nothing moves after the reduce-scatter) and
    # with clipping and accumulation (every row all-gathered for the norm); the MLP's rows, with
    # fewer matrices than devices, send the even pieces to their owners by an all-to-all. (The
    # 16 matrices compile slower than the MLP: the rows around the update stay on the MLP.)
    owner = lambda stage, **kw: jddp.ZeRO(stage=stage, shard="owner", **kw)
    acc = lambda: jddp.Accumulate(steps=2)
    caps = lambda: jddp.Buckets(**OWNER_CAPS)
    many = lambda s: {"place": owner(s), "reduce": caps()}
    many_acc = lambda s: {"place": owner(s), "reduce": caps(), "accumulate": acc()}
    for label, case, opts, topology, stage, procs in [
        ("owner muon, 16 matrices", "many_muon", many, "1d", 2, 2),
        ("owner muon, 16 matrices + accumulate", "many_muon_accumulate", many_acc, "1d", 1, 1),
        ("owner muon, 16 matrices + accumulate", "many_muon_accumulate", many_acc, "1d", 2, 1),
        ("owner muon, 16 matrices + accumulate", "many_muon_accumulate", many_acc, "1d", 3, 2),
        ("owner muon + hybrid", "muon", lambda s: {"place": owner(s, hybrid=True)}, "2l", 3, 1),
        ("owner muon, fewer matrices than devices", "muon", lambda s: {"place": owner(s)}, "1d",
         2, 2),
        ("owner muon + offload", "muon", lambda s: {"place": owner(s, offload=True)}, "1d", 2, 1),
        ("owner muon + skip_not_finite", "muon",
         lambda s: {"place": owner(s), "skip_not_finite": True}, "1d", 3, 1),
        ("owner muon", "muon", lambda s: {"place": owner(s)}, "2l", 2, 1),
        ("owner muon + reshard_after_forward=False", "muon",
         lambda s: {"place": owner(s, reshard_after_forward=False)}, "1d", 3, 1),
        ("owner clip_by_global_norm + adam", "clip", lambda s: {"place": owner(s)}, "1d", 2, 1),
        ("owner lamb", "lamb", lambda s: {"place": owner(s)}, "1d", 3, 1),
        ("owner adafactor", "adafactor", lambda s: {"place": owner(s)}, "1d", 1, 1),
    ]:
        # Their 2-process runs are tests/test_owner.py's (one launch of its own: this file's
        # launch has a time bound for the other rows).
        route = {"many_muon": "balanced", "many_muon_accumulate": "balanced"}.get(case)
        if label == "owner muon, fewer matrices than devices":
            route = "even"
        c.append(Cell(label, lambda o=opts, s=stage: o(s), topology, stage, equal(case, 1e-6),
                      extra={"owner_procs": procs, **({"route": route} if route else {})}))
    return c


CELLS = _cells()


def cell_id(cell: Cell) -> str:
    return f"{cell.name}|{cell.topology}|stage{cell.stage}|{cell.api}"


def mesh_for(topology: str, multi: bool = False):
    if topology == "1d":
        return jddp.data_mesh()
    if topology == "1d6":  # a device count that is not a power of two
        return jddp.data_mesh(jax.devices()[:6])
    return jddp.data_mesh(hosts="process" if multi else 2)


def _to_numpy(tree):
    from jax.experimental import multihost_utils

    def get(x):
        if jax.process_count() == 1:
            return np.asarray(x)
        if x.is_fully_replicated:  # no collective (each one is a program of its own)
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)


# A cell named by its features ({"hook": ..., "accumulate_steps": 2, ...}): each feature is
# the field of the policy that owns it (jddp._src.api.deprecated.OWNERS, the same bits).
FEATURES = {"reduce": {"hook": "hook", "chain": "chain"},
            "loss": {"weighted": "weighted", "rng": "rng", "has_aux": "has_aux",
                     "sum_metrics": "sum_metrics", "model_state_sync": "model_state_sync"},
            "accumulate": {"accumulate_steps": "steps", "microbatches": "microbatches",
                           "shard_accumulator": "shard"},
            "place": {"hybrid_shard": "hybrid", "reshard_after_forward": "reshard_after_forward"}}
POLICIES = {"reduce": jddp.Buckets, "loss": jddp.Loss, "accumulate": jddp.Accumulate}


def _options(cell: Cell, caps: dict) -> dict:
    """The cell's policy keywords at its stage, with ``caps``: a cell named by its features
    ({"hook": ..., "accumulate_steps": 2}) gets each as the field of the policy that owns it
    (jddp._src.api.deprecated.OWNERS: the same bits); policies it gives are kept as given."""
    opts: dict[str, Any] = {}
    fields: dict[str, dict] = {k: {} for k in FEATURES}
    features = cell.options()
    for name, value in features.items():
        owner = next((k for k, f in FEATURES.items() if name in f), None)
        if owner is not None:
            fields[owner][FEATURES[owner][name]] = value
        elif name == "local_sgd":
            opts["sync"] = value
        elif name == "mixed_precision":
            opts["precision"] = value
        elif name == "skip_not_finite":
            if value and "loss_scale" not in features:  # a loss scale skips too
                opts["loss_scale"] = jddp.SkipNotFinite()
        else:
            opts[name] = value
    if "reduce" not in opts:
        fields["reduce"].update(caps)
    for owner, policy in POLICIES.items():
        if fields[owner]:
            assert owner not in opts, (cell.name, owner)
            opts[owner] = policy(**fields[owner])
    if cell.stage and "place" not in opts:
        opts["place"] = jddp.ZeRO(stage=cell.stage, **fields["place"])
    return opts


def run_cell(cell: Cell, multi: bool = False, repeats: int = 1) -> Any:
    """Trains the cell's case with ``DataParallel`` (raises what construction raises); returns
    the final (global) parameters as numpy arrays (with ``repeats``, a list: the same compiled
    step run again from the initial state)."""
    _, case_name, _ = cell.expect if cell.expect[0] == "equal" else (None, "plain", None)
    case = CASES[case_name]
    mesh = mesh_for(cell.topology, multi)
    caps = {} if cell.extra.get("default_plan") else CAPS
    opts = _options(cell, caps)
    if cell.api == "nnx":
        from flax import nnx

        model = nnx.Linear(SIZES[0], SIZES[-1], rngs=nnx.Rngs(0))
        jddp.nnx.DataParallel(model, case.optimizer(), loss_fn=lambda m, b: jnp.mean(
            (m(b["x"]) - b["y"]) ** 2), mesh=mesh, **opts)
        raise AssertionError("expected a refusal")
    ddp = jddp.DataParallel(case.loss, case.optimizer(), mesh=mesh, **opts)
    runs = []
    for _ in range(repeats):
        if case.model_state is None:
            state = ddp.init(case.params())
        else:
            state = ddp.init(case.params(), case.model_state)
        for call in case.calls():
            batch = jddp.shard_batch(call["batch"], mesh)
            kw = {"rng": call["rng"]} if "rng" in call else {}
            mask = call.get("mask")
            if mask is not None:
                mask = jddp.shard_batch(mask, mesh)
            state, _ = ddp.step(state, batch, mask, **kw)
        runs.append(_to_numpy(ddp.global_params(state)))
    _check_owner_route(cell, ddp, case.params())
    return runs[0] if repeats == 1 else runs


def _reference(case: str, replicas: int) -> Any:
    """The case's reference parameters, trained once per process for each reference function
    and, where it reads it, replica count (the DiLoCo cases share one)."""
    c = CASES[case]
    return _trained_reference(c.reference, replicas if c.replicas else 0)


@functools.cache
def _trained_reference(reference: Callable[[int], Any], replicas: int) -> Any:
    return reference(replicas)


def _replicas(cell: Cell) -> int:
    return 2 if cell.topology == "2l" else 8


@functools.cache
def _one_process(index: int) -> Any:
    return run_cell(CELLS[index])


@pytest.mark.parametrize("index", range(len(CELLS)), ids=[cell_id(c) for c in CELLS])
def test_cell(index):
    cell = CELLS[index]
    if cell.expect[0] == "refused":
        with pytest.raises((ValueError, TypeError), match=cell.expect[1]):
            run_cell(cell)
        return
    _, case, tol = cell.expect
    got = _one_process(index)
    assert ref.max_abs_diff(got, _reference(case, _replicas(cell))) < tol


def test_syncbn_cells_leave_the_scale_to_jax_where_declared():
    """The default-plan SyncBN cells run the path they are declared for: the scale in no
    bucket at stage 0 with every call synchronising, in a bucket with accumulation or ZeRO."""
    batch = jddp.shard_batch(_batches(1)[0], jddp.data_mesh())
    seen = {}
    for cell in CELLS:
        if not cell.name.startswith("syncbn"):
            continue
        case = CASES[cell.expect[1]]
        ddp = jddp.DataParallel(case.loss, case.optimizer(), **_options(cell, {}))
        plan = ddp.plan(case.params(), batch, case.model_state)
        seen[cell_id(cell)] = tuple(plan.paths[i] for i in plan.implicit)
    scale = ("BN.scale",)
    assert seen == {
        "syncbn default plan|1d|stage0|functional": scale,
        "syncbn default plan + skip_not_finite|1d|stage0|functional": scale,
        "syncbn default plan + loss_scale|1d|stage0|functional": scale,
        "syncbn default plan + accumulate_steps=2|1d|stage0|functional": (),
        "syncbn default plan|1d|stage2|functional": (),
    }


def _check_owner_route(cell: Cell, ddp: Any, params: Any) -> None:
    """An owner cell runs the path it is declared for (``extra["route"]``), read from the plan
    of the step it trained (``ddp.bucket_plan``; no extra trace): on 16 matrices the balanced
    owner rows (two buckets, every row of each bucket's reduce-scatter exactly its owner's
    leaves, no gradient all-to-all, the owners' updates as many bytes as even ZeRO's at stages
    1-2); on the MLP (fewer matrices than devices) the even pieces sent to their owners."""
    from jddp._src.place import owner_plan

    route = cell.extra.get("route")
    if route is None:
        return
    routes = ddp.config.place.owners(ddp.config.topology, params, ddp.bucket_plan).routes
    kinds = {r.kind for r in routes.buckets}
    if route == "balanced":
        assert kinds == ({owner_plan.BALANCED} if cell.stage >= 2 else set()), cell_id(cell)
        assert ddp.bucket_plan.num_buckets == 2 and routes.grads_bytes == 0, cell_id(cell)
        assert routes.pieces or routes.updates_bytes == routes.even_updates_bytes, cell_id(cell)
    else:
        assert kinds == {owner_plan.EVEN} and routes.grads_bytes > 0, cell_id(cell)


def test_owner_cells_cover_the_balanced_and_the_fallback_paths():
    """Balanced owner rows at every stage 1-3, with accumulation, and on 2 processes; the
    fallback (even pieces to the owners) in at least one cell (each checked when it runs:
    :func:`_check_owner_route`)."""
    declared = {(c.extra["route"], c.stage, c.expect[1].endswith("accumulate"),
                 c.extra["owner_procs"]) for c in CELLS if c.extra.get("route")}
    balanced = {(s, a, p) for r, s, a, p in declared if r == "balanced"}
    assert {(s, True) for s, a, _ in balanced if a} == {(1, True), (2, True), (3, True)}
    assert {s for s, _, p in balanced if p == 2} >= {2, 3}
    assert any(r == "even" for r, *_ in declared)


def test_matrix_is_declared_consistently():
    """Every cell is unique, names a known case, and a refusal states a reason."""
    ids = [cell_id(c) for c in CELLS]
    assert len(ids) == len(set(ids))
    for c in CELLS:
        assert c.topology in ("1d", "2l", "1d6") and c.stage in range(4) and c.procs in (1, 2)
        assert c.topology != "1d6" or c.expect[0] == "refused"
        assert c.expect[0] in ("equal", "refused")
        if c.expect[0] == "equal":
            assert c.expect[1] in CASES and 0 < c.expect[2] < 1e-1
        else:
            assert c.expect[1] and c.procs == 1
    assert sum(c.procs == 2 for c in CELLS) >= 11
    for case in CASES.values():  # a reference that reads the replica count is declared so
        takes = list(inspect.signature(case.reference).parameters) == ["replicas"]
        assert case.replicas == takes, case


def test_refused_cells_are_the_compat_table():
    """The matrix's refused combinations are exactly the rows of jddp's one table of refused
    combinations (jddp._src.step.compat): one cell per row, each raising that row's reason. The
    one other refused cell is a value checked against the mesh, not a combination."""
    rows = [c.name for c in CELLS if c.extra.get("row")]
    declared = {c.expect[1] for c in CELLS if c.extra.get("row")}
    assert declared == {re.escape(r.reason) for r in compat.TABLE}
    assert len(rows) == len(compat.TABLE)
    others = [cell_id(c) for c in CELLS if c.expect[0] == "refused" and not c.extra.get("row")]
    assert others == ["reshard_after_forward=3|1d|stage3|functional"]


# --------------------------------------------------------------------------- the process rows

SCRIPT = r'''
import json, os, sys
import jax
import jddp
cache = sys.argv[2]
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jddp.initialize(timeout_s=60)
import numpy as np
from tests import test_matrix as tm
out = {}
for i, cell in enumerate(tm.CELLS):
    if cell.procs != 2:
        continue
    runs = tm.run_cell(cell, multi=True, repeats=2)  # the second run reuses the compiled step
    out[str(i)] = [[np.asarray(x).tolist() for x in jax.tree.leaves(r)] for r in runs]
if jax.process_index() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
print("DONE", jax.process_count())
'''


@pytest.mark.slow
def test_two_processes(tmp_path):
    """The ``procs=2`` cells on 2 processes x 4 devices over Gloo: two runs bitwise equal, each
    equal to the 1 x 8 run (float32 summation order) and to the reference."""
    script = tmp_path / "matrix_job.py"
    script.write_text(SCRIPT)
    rc, out, err, _ = run_launcher(
        ["-n", "2", "--devices-per-process", "4", "--timeout", "280", str(script),
         str(tmp_path / "out.json"), str(tmp_path / "cache")], timeout=300)
    assert rc == 0, (out[-2000:], err[-4000:])
    results = json.loads((tmp_path / "out.json").read_text())
    multi = [i for i, c in enumerate(CELLS) if c.procs == 2]
    assert sorted(map(int, results)) == multi
    for i in multi:
        cell = CELLS[i]
        first, second = ([np.asarray(x, np.float32) for x in r] for r in results[str(i)])
        for a, b in zip(first, second, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{cell_id(cell)}: repeats differ")
        one = jax.tree.leaves(_one_process(i))
        _, case, tol = cell.expect
        assert ref.max_abs_diff(first, one) < max(2e-6, tol / 10), cell_id(cell)
        assert ref.max_abs_diff(first, jax.tree.leaves(_reference(case, _replicas(cell)))) < tol

