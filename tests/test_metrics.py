"""Metrics: sums declared with sum_metrics (no extra collective), and optimizer-side metrics
(optax.inject_hyperparams values) in the step's metrics."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.step.objective import STEP_METRICS
from tests._models import mlp_params

SIZES = [6, 16, 3]


def _classify(params, batch):
    h = jnp.tanh(batch["x"] @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    return h @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]


def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, SIZES[0])).astype(np.float32),
            "label": rng.integers(0, SIZES[-1], size=(n,)).astype(np.int32)}


def _loss(params, batch):
    logits = _classify(params, batch)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["label"])
    return loss, {"correct": correct, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
                  "examples": jnp.asarray(batch["label"].shape[0], jnp.float32)}


@pytest.mark.parametrize("microbatches", [1, 2])
def test_sum_metrics_are_totals_over_devices_and_microbatches(microbatches):
    params = mlp_params(0, SIZES)
    batch = _batch(64)
    ddp = jddp.DataParallel(_loss, optax.sgd(0.0),
                            loss=jddp.Loss(has_aux=True, sum_metrics=("correct", "examples")),
                            accumulate=jddp.Accumulate(microbatches=microbatches))
    _, metrics = ddp.step(ddp.init(params), batch)
    want = int(np.sum(np.argmax(_classify(params, batch), -1) == batch["label"]))
    assert 0 < want < 64
    assert float(metrics["correct"]) == want
    assert float(metrics["examples"]) == 64.0
    assert float(metrics["accuracy"]) == pytest.approx(want / 64, abs=1e-6)  # still a mean


def test_weighted_sum_metrics_count_real_tokens_only():
    """Per-token arrays named in sum_metrics are summed over the mask's real entries (weighted),
    scalars over devices; the token count is the mask's sum."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 5, size=(16, 7)).astype(np.int32)
    mask = rng.random((16, 7)) < 0.6
    mask[3] = False  # an example with no real token

    def loss(params, batch):
        logits = batch["t"][..., None] * params["w"]  # (b, seq, 5)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["t"])
        return per_token, {"tokens": jnp.ones_like(per_token), "shards": jnp.ones(())}

    ddp = jddp.DataParallel(loss, optax.sgd(0.1),
                            loss=jddp.Loss(has_aux=True, weighted=True, sum_metrics=["tokens",
                                                                                     "shards"]))
    _, metrics = ddp.step(ddp.init({"w": jnp.linspace(0.1, 1.0, 5)}), {"t": tokens}, mask=mask)
    assert float(metrics["tokens"]) == mask.sum()
    assert float(metrics["shards"]) == 8.0


def test_injected_hyperparameters_are_reported_as_metrics():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=3, decay_steps=10)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule, momentum=0.9, nesterov=True),
    )
    ddp = jddp.DataParallel(_loss, tx, loss=jddp.Loss(has_aux=True))
    state = ddp.init(mlp_params(0, SIZES))
    lrs = []
    for i in range(5):
        state, metrics = ddp.step(state, _batch(32, seed=i))
        lrs.append(float(metrics["learning_rate"]))
        assert float(metrics["momentum"]) == pytest.approx(0.9)
    np.testing.assert_allclose(lrs, [float(schedule(i)) for i in range(5)], rtol=1e-6)


def test_two_injected_states_are_told_apart_by_path():
    tx = optax.chain(optax.inject_hyperparams(optax.scale)(step_size=0.5),
                     optax.inject_hyperparams(optax.scale)(step_size=-0.1))
    ddp = jddp.DataParallel(lambda p, b: _loss(p, b)[0], tx)
    _, metrics = ddp.step(ddp.init(mlp_params(0, SIZES)), _batch(16))
    assert float(metrics["0.step_size"]) == 0.5
    assert float(metrics["1.step_size"]) == pytest.approx(-0.1)


def test_metric_errors_are_clear():
    params = mlp_params(0, SIZES)
    with pytest.raises(ValueError, match=r"sum_metrics=\('correct',\) names aux metrics.*has_aux"):
        jddp.DataParallel(lambda p, b: _loss(p, b)[0], optax.sgd(0.1),
                          loss=jddp.Loss(sum_metrics="correct"))
    with pytest.raises(ValueError, match="names a metric twice"):
        jddp.DataParallel(_loss, optax.sgd(0.1), loss=jddp.Loss(has_aux=True, sum_metrics=("a",
                                                                                           "a")))
    ddp = jddp.DataParallel(_loss, optax.sgd(0.1),
                            loss=jddp.Loss(has_aux=True, sum_metrics=("tokens",)))
    with pytest.raises(ValueError, match=r"Loss\.sum_metrics names \['tokens'\].*\['accuracy', "):
        ddp.step(ddp.init(params), _batch(16))

    def clashing(p, b):
        return _loss(p, b)[0], {"learning_rate": jnp.zeros(())}

    ddp = jddp.DataParallel(clashing, optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                            loss=jddp.Loss(has_aux=True))
    with pytest.raises(ValueError, match=r"\['learning_rate'\] come both from loss_fn"):
        ddp.step(ddp.init(params), _batch(16))


def test_sum_metrics_and_optimizer_metrics_add_no_collective():
    """Sums ride on the last bucket's all-reduce like the means; hyperparameters are read from
    the replicated optimizer state: one all-reduce per bucket, as without them."""
    from jddp.perf import schedule

    params = mlp_params(0, SIZES)
    batch = _batch(32)
    caps = dict(cap_mb=0.0005, first_mb=0.0002)
    ddp = jddp.DataParallel(_loss, optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                            reduce=jddp.Buckets(**caps),
                            loss=jddp.Loss(has_aux=True, sum_metrics=("correct", "examples")))
    text = ddp.step.lower(ddp.init(params), batch).compile().as_text()
    assert ddp.bucket_plan.num_buckets >= 2
    assert len(schedule.collectives(text, "all-reduce")) == ddp.bucket_plan.num_buckets


def _named(name):
    def loss(p, b):
        return _loss(p, b)[0], {name: jnp.zeros(())}
    return loss


@pytest.mark.parametrize("name", sorted(STEP_METRICS))
def test_an_aux_metric_may_not_take_a_name_the_step_writes(name):
    """The step's own value would silently replace the user's: refused, naming the metric."""
    ddp = jddp.DataParallel(_named(name), optax.sgd(0.1), loss=jddp.Loss(has_aux=True))
    with pytest.raises(ValueError, match=rf"aux metrics use \['{name}'\], a name the step writes"):
        ddp.lower(mlp_params(0, SIZES), _batch(16))
    with pytest.raises(ValueError, match=rf"sum_metrics use \['{name}'\]"):
        jddp.DataParallel(_loss, optax.sgd(0.1), loss=jddp.Loss(has_aux=True, sum_metrics=(name,)))


def test_the_step_writes_only_the_reserved_names():
    """STEP_METRICS is the one list: every kind of step (plain, no-sync and sync calls, weighted
    with loss scaling, a two-level mesh, local SGD's local and averaging steps) writes no metric
    outside it besides the user's own."""
    params, batch = mlp_params(0, SIZES), _batch(16)
    user = {"correct", "accuracy", "examples"}
    two = jddp.data_mesh(hosts=2)
    lowered = []
    for kw, calls in [
        ({"accumulate": jddp.Accumulate(steps=2), "mesh": two,
          "loss_scale": jddp.precision.DynamicScale()}, [{"sync": False}, {"sync": True}]),
        ({"sync": jddp.local_sgd.post_local_sgd(2), "mesh": two}, [{"step": 0}, {"step": 1}]),
    ]:
        ddp = jddp.DataParallel(_loss, optax.sgd(0.1), loss=jddp.Loss(has_aux=True), **kw)
        for call in calls:
            lowered.append(set(ddp.step.lower(ddp.init(params), batch, **call).out_info[1]))
    written = set().union(*lowered) - user
    assert written <= set(STEP_METRICS), written - set(STEP_METRICS)
    assert {"local_loss", "comm_bytes_hosts", "synced", "averaged", "replica_loss", "skipped",
            "loss_scale"} <= written


def _same_examples_loss(params, batch):
    """The loss, the same loss again as an aux metric, and a summed row count: when every
    metric covers the same examples, ``loss == same_loss`` and ``rows`` counts those examples."""
    logits = _classify(params, batch)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"same_loss": loss, "rows": jnp.asarray(batch["label"].shape[0], jnp.float32)}


_SYNCS = {"every_step": (None, None), "diloco": (jddp.local_sgd.diloco(2), 2),
          "deterministic": ("deterministic", None)}
_ACCUMULATE = {"none": None, "steps2": jddp.Accumulate(steps=2),
               "steps2_micro2": jddp.Accumulate(steps=2, microbatches=2)}


@pytest.mark.parametrize("acc", sorted(_ACCUMULATE))
@pytest.mark.parametrize("sync", sorted(_SYNCS))
def test_every_metric_covers_the_calls_examples(sync, acc, monkeypatch):
    """``loss`` and every aux metric (means and ``sum_metrics``) cover the same examples, this
    call's, in every combination of accumulation and sync policy: wherever ``loss`` is computed,
    the aux copy of the loss equals it and the row count is the call's global batch; where it is
    not (a call without a cross-replica collective), none of them is. ``window_loss`` on a call
    that closes an accumulation window is the mean of the window's calls' losses (each device's
    ``local_loss``), and no call that reduced reports NaN."""
    spec, hosts = _SYNCS[sync]
    mesh = jddp.data_mesh() if hosts is None else jddp.data_mesh(hosts=hosts)
    opts: dict = dict(loss=jddp.Loss(has_aux=True, sum_metrics=("rows",)), mesh=mesh)
    if spec == "deterministic":  # its reduction (this process's XLA still emits FMAs: the
        # environment check passes, the relations below hold whatever the rounding)
        jax.devices()  # the backend starts with conftest's flags, not these
        monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX")
        opts["reduce"], spec = jddp.Deterministic(group_size=2), None
    elif spec is not None:
        opts["sync"] = spec
    if _ACCUMULATE[acc] is not None:
        opts["accumulate"] = _ACCUMULATE[acc]
    ddp = jddp.DataParallel(_same_examples_loss, optax.sgd(0.1), **opts)
    state = ddp.init(mlp_params(0, SIZES))
    rows, window, computed = 32, [], 0
    for i in range(8):
        state, m = ddp.step(state, _batch(rows, seed=i))
        loss, same, n = (float(m[k]) for k in ("loss", "same_loss", "rows"))
        assert np.isfinite(loss) == np.isfinite(same) == np.isfinite(n), (i, m)
        synced = bool(m.get("synced", True))
        reduced = synced and (spec is None or bool(m["averaged"]))
        if "local_loss" in m:
            window.append(float(np.mean(np.asarray(m["local_loss"]))))
        if reduced:
            assert np.isfinite(loss), (i, m)
        if np.isfinite(loss):
            computed += 1
            assert same == pytest.approx(loss, rel=1e-6, abs=1e-7), (i, loss, same)
            assert n == rows, (i, n)
        if "window_loss" in m and reduced:
            assert np.isfinite(float(m["window_loss"])), (i, m)
        if "window_loss" in m and reduced and window:  # (Deterministic: no local_loss)
            assert float(m["window_loss"]) == pytest.approx(np.mean(window), rel=1e-5), i
        if synced:
            window = []
    assert computed >= 2
