"""Uneven final batches: pad_batch + weighted=True equals a single-device step on the real examples."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp

# float32 on CPU; the DP and single-device steps sum in different orders, so agreement is to a few
# ulps of the parameters' magnitude.
RTOL, ATOL = 2e-5, 2e-6


def _init(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (6, 16)) * 0.3,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 1)) * 0.3,
    }


def _per_example(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return ((h @ params["w2"])[:, 0] - batch["y"]) ** 2


def _mean_loss(params, batch):
    return _per_example(params, batch).mean()


def _data(n, seed=1):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((n, 6)).astype(np.float32),
        "y": rng.standard_normal(n).astype(np.float32),
    }


def test_pad_batch_pads_to_a_multiple_and_masks():
    batch = _data(13)
    padded, mask = jddp.data.pad_batch(batch, 8)
    assert padded["x"].shape == (16, 6) and mask.shape == (16,) and mask.dtype == np.bool_
    assert mask.sum() == 13 and mask[:13].all()
    np.testing.assert_array_equal(padded["x"][13:], np.repeat(batch["x"][-1:], 3, 0))
    full, mask = jddp.data.pad_batch(batch, 8, size=32)
    assert full["y"].shape == (32,) and mask.sum() == 13
    same, mask = jddp.data.pad_batch(_data(16), 8)
    assert same["x"].shape == (16, 6) and mask.all()
    jax_padded, _ = jddp.data.pad_batch({"x": jnp.ones((3, 2))}, 4)
    assert isinstance(jax_padded["x"], jax.Array) and jax_padded["x"].shape == (4, 2)
    with pytest.raises(ValueError, match="multiple of the 8 devices"):
        jddp.data.pad_batch(batch, 8, size=20)
    with pytest.raises(ValueError, match="different leading dimensions"):
        jddp.data.pad_batch({"x": np.ones((3, 1)), "y": np.ones(4)}, 8)


@pytest.mark.parametrize("opt", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"])
@pytest.mark.parametrize("n_real", [13, 3])
def test_padded_step_equals_single_device_on_real_examples(opt, n_real):
    params = _init()
    ddp = jddp.DataParallel(_per_example, opt, loss=jddp.Loss(weighted=True))
    state = ddp.init(params)
    ref_params, ref_opt = params, opt.init(params)
    for step in range(3):
        real = _data(n_real, seed=10 + step)
        padded, mask = jddp.data.pad_batch(real, ddp.num_devices, size=16)
        state, metrics = ddp.step(state, padded, mask=mask)
        loss, grads = jax.value_and_grad(_mean_loss)(ref_params, real)
        updates, ref_opt = opt.update(grads, ref_opt, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
                 state.params, ref_params)
    ddp.verify(state)


def test_weighted_without_mask_is_the_plain_mean_and_weights_are_honoured():
    params = _init()
    batch = _data(16)
    ddp = jddp.DataParallel(_per_example, optax.sgd(0.1), loss=jddp.Loss(weighted=True))
    plain = jddp.DataParallel(_mean_loss, optax.sgd(0.1))
    a, ma = ddp.step(ddp.init(params), batch)
    b, mb = plain.step(plain.init(params), batch)
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=RTOL)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL),
                 a.params, b.params)
    # Per-example float weights: a weighted mean.
    w = np.random.default_rng(3).uniform(0, 2, 16).astype(np.float32)
    c, mc = ddp.step(ddp.init(params), batch, mask=w)
    ref = lambda p: jnp.sum(w * _per_example(p, batch)) / w.sum()
    loss, grads = jax.value_and_grad(ref)(params)
    np.testing.assert_allclose(mc["loss"], loss, rtol=RTOL)
    jax.tree.map(lambda x, p, g: np.testing.assert_allclose(x, p - 0.1 * g, rtol=RTOL, atol=ATOL),
                 c.params, params, grads)


def test_per_example_metrics_are_averaged_over_real_examples():
    def loss_fn(params, batch):
        losses = _per_example(params, batch)
        return losses, {"abs_err": jnp.sqrt(losses), "const": jnp.float32(2.0)}

    real = _data(11)
    padded, mask = jddp.data.pad_batch(real, 8)
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), loss=jddp.Loss(has_aux=True, weighted=True))
    _, metrics = ddp.step(ddp.init(_init()), padded, mask=mask)
    np.testing.assert_allclose(
        metrics["abs_err"], np.sqrt(_per_example(_init(), real)).mean(), rtol=RTOL
    )
    np.testing.assert_allclose(metrics["const"], 2.0)


def test_inf_loss_on_padding_is_ignored():
    def loss_fn(params, batch):
        losses = _per_example(params, batch)
        return jnp.where(batch["pad"], jnp.inf, losses)  # padding rows would be Inf

    real = _data(13)
    real["pad"] = np.zeros(13, bool)
    padded, mask = jddp.data.pad_batch(real, 8)
    padded["pad"] = ~mask
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), loss=jddp.Loss(weighted=True))
    state, metrics = ddp.step(ddp.init(_init()), padded, mask=mask)
    assert np.isfinite(metrics["loss"])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))


def test_mask_errors():
    params, batch = _init(), _data(16)
    ddp = jddp.DataParallel(_per_example, optax.sgd(0.1), loss=jddp.Loss(weighted=True))
    state = ddp.init(params)
    with pytest.raises(ValueError, match=r"mask has shape \(8,\) but the batch has 16 examples"):
        ddp.step(state, batch, mask=np.ones(8, bool))
    # A per-token mask must be shaped like the unreduced loss (here per example: (16,)).
    with pytest.raises(TypeError, match=r"shaped like the mask.*shape \(2, 1\).*float32\[2\]"):
        ddp.step(state, batch, mask=np.ones((16, 1), bool))
    plain = jddp.DataParallel(_mean_loss, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"jddp\.Loss\(weighted=True\)"):
        plain.step(plain.init(params), batch, mask=np.ones(16, bool))
    with pytest.raises(TypeError, match="must return the unreduced losses"):
        wrong = jddp.DataParallel(_mean_loss, optax.sgd(0.1), loss=jddp.Loss(weighted=True))
        wrong.step(wrong.init(params), batch)
    with pytest.raises(ValueError, match="jddp.data.pad_batch"):
        plain.step(plain.init(params), _data(13))


# ------------------------------------------------------------------------ per-token weights


class _TinyLM:
    """A token-level LM small enough to run everywhere: embedding, one tanh layer, logits."""

    vocab, dim = 11, 8

    @staticmethod
    def init(seed=0):
        k = jax.random.split(jax.random.key(seed), 3)
        return {
            "embed": jax.random.normal(k[0], (_TinyLM.vocab, _TinyLM.dim)) * 0.5,
            "w": jax.random.normal(k[1], (_TinyLM.dim, _TinyLM.dim)) * 0.3,
            "out": jax.random.normal(k[2], (_TinyLM.dim, _TinyLM.vocab)) * 0.3,
        }

    @staticmethod
    def per_token(params, batch):
        """(batch, seq) next-token losses (the target of position t is token t + 1)."""
        h = jnp.tanh(params["embed"][batch["inputs"]] @ params["w"])
        logits = h @ params["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


def _lm_data(seed):
    """16 sequences of 9 tokens with padding (token 0) after a random length: the real-token
    count differs from device to device, and device 1 (sequences 2, 3) has none at all."""
    rng = np.random.default_rng(seed)
    seqs = rng.integers(1, _TinyLM.vocab, size=(16, 9)).astype(np.int32)
    lengths = rng.integers(2, 10, size=16)
    lengths[2:4] = 0
    for i, n in enumerate(lengths):
        seqs[i, n:] = 0
    batch = {"inputs": seqs[:, :-1], "targets": seqs[:, 1:]}
    weights = (batch["targets"] != 0).astype(np.float32)  # padding targets weigh nothing
    return batch, weights


@pytest.mark.parametrize("opt", [optax.sgd(0.5), optax.adamw(1e-2)], ids=["sgd", "adamw"])
def test_per_token_weighted_lm_on_8_devices_equals_single_device_on_real_tokens(opt):
    """weighted=True with a (batch, seq) mask: the step's gradient is the mean over the global
    batch's real tokens (not a mean of per-device means), as on one device."""
    params = _TinyLM.init()
    ddp = jddp.DataParallel(_TinyLM.per_token, opt,
                            reduce=jddp.Buckets(cap_mb=0.0005, first_mb=0.0002),
                            loss=jddp.Loss(weighted=True))
    state = ddp.init(params)

    def ref_loss(p, batch, weights):
        return jnp.sum(_TinyLM.per_token(p, batch) * weights) / jnp.sum(weights)

    ref_params, ref_opt = params, opt.init(params)
    for seed in range(3):
        batch, weights = _lm_data(seed)
        per_device = weights.reshape(8, -1).sum(1)
        assert per_device[1] == 0 and len(set(per_device.tolist())) > 2  # uneven, one empty
        state, metrics = ddp.step(state, batch, mask=weights)
        loss, grads = jax.value_and_grad(ref_loss)(ref_params, batch, weights)
        updates, ref_opt = opt.update(grads, ref_opt, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=RTOL)
    # The test can tell: a mean of the non-empty devices' token means is another number.
    batch, weights = _lm_data(0)
    tok = np.asarray(_TinyLM.per_token(params, batch)) * weights
    dev = [tok[i:i + 2].sum() / weights[i:i + 2].sum() for i in range(0, 16, 2)
           if weights[i:i + 2].sum()]
    assert abs(np.mean(dev) - tok.sum() / weights.sum()) > 1e-3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
                 jax.device_get(state.params), jax.device_get(ref_params))
