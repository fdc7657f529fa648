"""The sharded accumulator (``jddp.Accumulate(shard=True)``, ZeRO stages 2-3): every accumulating
call reduce-scatters its gradients into a ``P/N`` accumulator split like the parameters.

It must train exactly like the per-device accumulator and the single-device reference
(tests/_reference.py), hold ``(3P + P)/N`` at rest at stage 3 with Adam, and report the bytes of
the ``k`` reduce-scatters per window that its compiled programs contain.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.perf import schedule
from jddp.perf.traffic import sent_per_device
from tests import _reference as ref
from tests._models import max_abs_diff, mlp_loss, mlp_params, regression_batch

N = 8
SIZES = [8, 16, 16, 8]  # every leaf divisible by 8: the bounds below hold without slack
CAPS = dict(cap_mb=0.002, first_mb=0.001)
K = 4


def _per_example(p, b):
    x = b["x"]
    for i in range(3):
        x = x @ p[f"Dense_{i}"]["kernel"] + p[f"Dense_{i}"]["bias"]
        x = jax.numpy.tanh(x) if i < 2 else x
    return jax.numpy.mean((x - b["y"]) ** 2, axis=-1)


def _calls(rows=(16, 16, 16, 16), seed=0):
    return [regression_batch(100 * seed + i, r, SIZES[0], SIZES[-1]) for i, r in enumerate(rows)]


def _ddp(stage, shard, loss=mlp_loss, opt=None, hook=None, microbatches=1, weighted=False,
         donate=True):
    return jddp.DataParallel(loss, optax.adam(1e-2) if opt is None else opt,
                             reduce=jddp.Buckets(hook=hook, **CAPS),
                             accumulate=jddp.Accumulate(steps=K, microbatches=microbatches,
                                                        shard=shard),
                             loss=jddp.Loss(weighted=weighted),
                             place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate(),
                             donate=donate)


def _window(ddp, params, calls, masks=None, sync="auto"):
    state = ddp.init(params)
    for i, b in enumerate(calls):
        kw = {} if masks is None else {"mask": masks[i]}
        if sync == "explicit":
            kw["sync"] = i == len(calls) - 1
        state, metrics = ddp.step(state, b, **kw)
    return state, metrics


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_accumulator_equals_unsharded_and_reference(stage):
    """A window of 4 (Adam), sharded accumulator against the per-device one and one device."""
    params = mlp_params(1, SIZES)
    calls = _calls()
    want = ref.train(mlp_loss, optax.adam(1e-2), params, [calls])
    got = {}
    for shard, sync in ((True, "auto"), (True, "explicit"), (False, "auto")):
        state, metrics = _window(_ddp(stage, shard), params, calls, sync=sync)
        assert int(state.step) == 1 and bool(metrics["synced"])
        np.testing.assert_allclose(float(metrics["window_loss"]), want.losses[0], rtol=1e-6)
        got[shard, sync] = state.params
        assert max_abs_diff(state.params, want.params) < 1e-6, (shard, sync)
    assert max_abs_diff(got[True, "auto"], got[False, "auto"]) < 1e-6


@pytest.mark.parametrize("stage,m", [(2, 2), (3, 1)])
def test_weighted_uneven_window_with_masks(stage, m):
    """Masks, ``microbatches``, and an epoch's short last call (padded): the window equals one
    device on its real rows, pooled, at stages 2 and 3 with the sharded accumulator."""
    params = mlp_params(2, SIZES)
    calls = _calls((32, 32, 32, 16), seed=1)
    masks = [(np.arange(len(b["x"])) % (3 + i) != 0).astype(np.float32)
             for i, b in enumerate(calls)]
    masks[-1][11:] = 0.0  # the short call: 11 rows at most are real
    want = ref.train(_per_example, optax.sgd(0.1), params, [calls], masks=[masks],
                     weighted=True, pooled=True)
    ddp = _ddp(stage, True, loss=_per_example, opt=optax.sgd(0.1), weighted=True,
               microbatches=m)
    state, metrics = _window(ddp, params, calls, masks)
    np.testing.assert_allclose(float(metrics["window_loss"]), want.losses[0], rtol=1e-6)
    assert max_abs_diff(state.params, want.params) < 1e-6


def _held(tree):
    """Bytes of ``tree`` on device 0 (its shard of each array)."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == jax.devices()[0])


def test_state_at_rest_stage_3_holds_four_p_over_n():
    """Adam at stage 3 with accumulate_steps=4: params, moments and accumulator at (3P + P)/N
    per device (the per-device accumulator alone is P), in the state's arrays and in the
    compiled program's arguments."""
    params = mlp_params(3, SIZES)
    p = sum(x.nbytes for x in jax.tree.leaves(params))
    batch = _calls()[0]
    held, args = {}, {}
    for shard in (True, False):
        ddp = _ddp(3, shard)
        state = ddp.init(params)
        held[shard] = _held((state.params, state.opt_state, state.update_state.grads))
        rep = ddp.report(state, batch)
        assert rep.memory is not None and rep.memory.at_rest == _held(state)
        args[shard] = rep.memory.arguments
    assert held[True] <= 4 * p / N + 64, (held[True], p)  # 64: Adam's counter and the like
    assert held[False] >= 3 * p / N + p
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch)) // N
    assert args[True] <= 4 * p / N + batch_bytes + 256, (args[True], p)
    assert args[False] - args[True] >= p * (1 - 1 / N) - 64


def _collectives(ddp, state, batch, sync):
    text = ddp.step.lower(state, batch, sync=sync).compile().as_text()
    found = {}
    for c in schedule.collectives(text):
        found.setdefault(c.kind, []).append(c)
    return text, found


@pytest.mark.parametrize("stage", [2, 3])
def test_comm_bytes_and_collectives_of_each_call(stage):
    """An accumulating call runs one reduce-scatter per bucket (stage 3: and the all-gathers of
    the parameters, once per bucket in forward and again in backward), no all-reduce; its
    ``comm_bytes`` equals the compiled collectives' ring bytes, as does the synchronising call's
    (whose collectives are those of the per-device accumulator's)."""
    params, batch = mlp_params(4, SIZES), _calls()[0]
    sent = {}
    for shard in (True, False):
        ddp = _ddp(stage, shard, donate=False)
        state = ddp.init(params)
        for sync in (False, True):
            text, found = _collectives(ddp, state, batch, sync)
            k = ddp.bucket_plan.num_buckets
            assert k > 1 and "all-reduce" not in found
            scatters = len(found.get("reduce-scatter", []))
            assert scatters == (k if sync or shard else 0), (shard, sync, scatters)
            if not sync:  # (the sync call's all-gathers are the stage's, as without)
                # stage 3: one per bucket in forward, plus resharding's backward re-gathers.
                gathers = len(found.get("all-gather", []))
                assert (gathers >= k) if stage == 3 else (gathers == 0), gathers
            _, m = ddp.step.lower(state, batch, sync=sync).compile()(state, batch, None, None)
            sent[shard, sync] = float(m["comm_bytes"])
            hlo = sum(sent_per_device(c.kind, c.nbytes, len(c.groups[0]) if c.groups else N)
                      for c in schedule.collectives(text))
            assert sent[shard, sync] == pytest.approx(hlo, rel=1e-6), (shard, sync)
    assert sent[True, True] == sent[False, True]
    # A window: the per-device accumulator sends the sync call's bytes (+ stage 3's gathers);
    # the sharded one adds a reduce-scatter of the gradients per accumulating call.
    assert sent[True, False] > sent[False, False]


def test_option_defaults_and_errors():
    def cfg(stage, steps=1, hook=None, shard=None):
        return jddp.DataParallel(mlp_loss, optax.sgd(0.1), place=jddp.ZeRO(stage=stage),
                                 accumulate=jddp.Accumulate(steps=steps, shard=shard),
                                 reduce=jddp.Buckets(hook=hook)).config

    assert cfg(2, steps=2).accumulate.shard
    assert cfg(3, steps=2, hook=jddp.bf16_compress()).accumulate.shard
    assert not cfg(1, steps=2).accumulate.shard
    assert not cfg(3).accumulate.shard
    assert not cfg(3, steps=2, shard=False).accumulate.shard
    assert not cfg(2, steps=2, hook=jddp.powersgd()).accumulate.shard
    for kw, why in (({"stage": 1, "steps": 2}, "only ZeRO stages 2-3"),
                    ({"stage": 2}, "steps=1: there is no accumulator"),
                    ({"stage": 2, "steps": 2, "hook": jddp.powersgd()}, "the hook has state")):
        with pytest.raises(ValueError, match=f"Accumulate\\(shard=True\\).*{why}"):
            cfg(shard=True, **kw)
    with pytest.raises(TypeError, match="Accumulate.shard must be True or False"):
        cfg(2, steps=2, shard="yes")


def test_state_of_the_other_layout_is_a_clear_error():
    params, batch = mlp_params(5, SIZES), _calls()[0]
    sharded, local = _ddp(3, True), _ddp(3, False)
    with pytest.raises(ValueError, match=r"jddp\.Accumulate\(shard=\.\.\.\).*per device"):
        local.step(sharded.init(params), batch)
    with pytest.raises(ValueError, match=r"jddp\.Accumulate\(shard=\.\.\.\).*sharded"):
        sharded.step(local.init(params), batch)


def test_a_hook_with_state_for_some_leaves_is_refused():
    """The option probes the hook on one small leaf; a hook with a ``scatter`` that keeps state
    only for larger leaves is refused before compilation, naming the fix."""
    import jax.numpy as jnp

    base = jddp.hooks.allreduce_mean()
    hook = base._replace(name="big_leaves_state", init=lambda leaf: (
        {"r": jnp.zeros(leaf.shape, jnp.float32)} if len(leaf.shape) > 1 else ()))
    ddp = _ddp(2, None, hook=hook)
    assert ddp.config.accumulate.shard
    with pytest.raises(ValueError, match=r"'big_leaves_state' keeps state.*Accumulate\(\.\.\., shard=False\)"):
        ddp.step(ddp.init(mlp_params(6, SIZES)), _calls()[0])
