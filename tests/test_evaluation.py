"""jddp.evaluation.Evaluator: sums over a data set whose size the devices do not divide, every
real example counted once (Flax's pad_shard_unpad semantics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from tests._models import mlp_params

SIZES = [6, 16, 3]


def _logits(params, x):
    h = jnp.tanh(x @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    return h @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]


def _eval_fn(params, batch):
    logits = _logits(params, batch["x"])
    return {
        "correct": jnp.argmax(logits, -1) == batch["label"],
        "loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]),
        "count": jnp.ones(batch["label"].shape[0]),
    }


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, SIZES[0])).astype(np.float32),
            "label": rng.integers(0, SIZES[-1], size=(n,)).astype(np.int32)}


@pytest.mark.parametrize("n", [37, 16, 5])
def test_sums_count_every_real_example_once(n):
    params = mlp_params(0, SIZES)
    data = _data(n)
    evaluate = jddp.evaluation.Evaluator(_eval_fn, batch_size=16)
    sums = evaluate(jddp.mesh.replicate_tree(params, jddp.data_mesh()), data)
    logits = np.asarray(_logits(params, data["x"]))
    assert sums["count"] == n
    assert sums["correct"] == int(np.sum(np.argmax(logits, -1) == data["label"]))
    want = optax.softmax_cross_entropy_with_integer_labels(logits, data["label"]).sum()
    assert sums["loss"] == pytest.approx(float(want), rel=1e-5)
    assert evaluate._sums._cache_size() == 1  # the short last batch is padded: one program


def test_per_token_values_and_host_variables():
    """Per-token arrays are summed over every trailing dimension; host values are placed."""
    tokens = np.random.default_rng(1).integers(0, 4, size=(21, 5)).astype(np.int32)
    weights = (tokens > 0).astype(np.float32)

    def eval_fn(params, batch):
        per_token = (batch["t"] * params["s"]).astype(jnp.float32)
        return {"tokens": batch["w"], "total": per_token * batch["w"]}

    evaluate = jddp.evaluation.Evaluator(eval_fn, batch_size=8)
    sums = evaluate({"s": np.float32(2.0)}, {"t": tokens, "w": weights})
    assert sums["tokens"] == weights.sum()
    assert sums["total"] == float((tokens * 2.0 * weights).sum())


def test_a_trained_state_is_evaluated_in_place():
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(lambda p, b: _eval_fn(p, b)["loss"].mean(), optax.adam(1e-2))
    state = ddp.init(params)
    data = _data(40, seed=3)
    for i in range(3):
        state, _ = ddp.step(state, _data(32, seed=i))
    sums = jddp.evaluation.Evaluator(_eval_fn, mesh=ddp.mesh, batch_size=32)(state.params, data)
    host = jax.device_get(state.params)
    want = optax.softmax_cross_entropy_with_integer_labels(
        _logits(host, data["x"]), data["label"]).sum()
    assert sums["loss"] == pytest.approx(float(want), rel=1e-5)


def test_evaluator_errors_are_clear():
    with pytest.raises(ValueError, match="batch_size must be a positive multiple of the 8"):
        jddp.evaluation.Evaluator(_eval_fn, batch_size=12)
    evaluate = jddp.evaluation.Evaluator(lambda p, b: {"mean": jnp.mean(b["x"])}, batch_size=8)
    with pytest.raises(ValueError, match=r"'mean' has shape \(\).*one value per example"):
        evaluate({}, _data(8))
    with pytest.raises(TypeError, match="dict of per-example arrays"):
        jddp.evaluation.Evaluator(lambda p, b: b["x"], batch_size=8)({}, _data(8))
    with pytest.raises(ValueError, match="empty"):
        evaluate({}, _data(0))
