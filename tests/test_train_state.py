"""TrainState's layout: one field per policy role, the update wrappers' states nested (optax's
``inner_state``), read-only views of the old per-feature names, and checkpoints of the old
per-feature layout restored into the new one."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import jddp
import jddp.checkpoint as ckpt
from jddp._src.step.state import AccumState, LossScaleState, OuterState, TrainState, to_legacy
from jddp.precision import DynamicScale
from tests._models import mlp_loss, mlp_params

SIZES = [6, 16, 3]


def _batch(i: int, size: int = 16) -> dict:
    rng = np.random.default_rng(i)
    return {"x": rng.normal(size=(size, SIZES[0])).astype(np.float32),
            "y": rng.normal(size=(size, SIZES[-1])).astype(np.float32)}


def _ddp(**policies) -> jddp.DataParallel:
    return jddp.DataParallel(mlp_loss, optax.adam(1e-2), donate=False,
                             reduce=jddp.Buckets(hook=jddp.powersgd(rank=1, start_iter=0)),
                             **policies)


def test_train_state_has_one_field_per_policy_role_and_no_feature_slot():
    names = [f.name for f in dataclasses.fields(TrainState)]
    assert names == ["step", "params", "opt_state", "model_state", "reduce_state",
                     "update_state", "sync_state"]
    for old in ("hook_state", "accum", "loss_scale", "outer"):
        assert old not in names
    state = _ddp().init(mlp_params(0, SIZES))
    with pytest.raises(TypeError):
        state.replace(accum=None)  # a view, not a field


def test_update_state_nests_the_loss_scale_inside_the_window_and_views_read_the_nodes():
    params = mlp_params(0, SIZES)
    ddp = _ddp(accumulate=jddp.Accumulate(steps=2), loss_scale=DynamicScale(init_scale=8.0))
    state = ddp.init(params)
    chain = state.update_state
    assert isinstance(chain, AccumState) and isinstance(chain.inner, LossScaleState)
    assert chain.inner.inner is None
    # The views return the nested nodes themselves.
    assert state.accum is chain and state.loss_scale is chain.inner
    assert state.hook_state is state.reduce_state and state.outer is None
    assert float(state.loss_scale.scale) == 8.0
    assert len(state.reduce_state) == len(jax.tree.leaves(params))  # PowerSGD: one per leaf
    # Leaves in the order of the per-feature fields they replaced: accumulator, then loss scale
    # (the compiled programs' argument order); the views are no pytree children.
    window = [chain.count, *jax.tree.leaves(chain.grads), chain.loss, chain.weight]
    want = [*window, chain.inner.scale, chain.inner.fin_steps]
    assert all(x is y for x, y in zip(jax.tree.leaves(chain), want, strict=True))
    fields = (state.step, state.params, state.opt_state, state.model_state,
              state.reduce_state, state.update_state, state.sync_state)
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(fields))
    # A step keeps the nesting (an accumulating call, then the window's synchronising one).
    for i in range(2):
        state, _ = ddp.step(state, _batch(i))
        assert isinstance(state.update_state, AccumState)
        assert isinstance(state.update_state.inner, LossScaleState)
    assert int(state.step) == 1 and int(state.update_state.count) == 0
    alone = _ddp(loss_scale=DynamicScale()).init(params).update_state
    assert isinstance(alone, LossScaleState) and alone.inner is None
    assert _ddp().init(params).update_state is None


def test_sync_state_holds_diloco_outer_state():
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), mesh=jddp.data_mesh(hosts=2),
                            sync=jddp.local_sgd.diloco(2))
    state = ddp.init(mlp_params(0, SIZES))
    assert isinstance(state.sync_state, OuterState) and state.outer is state.sync_state


def _legacy_checkpoint(path, state):
    """``state`` saved as earlier versions saved it: the per-feature fields at the top."""
    import orbax.checkpoint as ocp

    mngr = ckpt.manager(path)
    mngr.save(int(state.step), args=ocp.args.Composite(
        default=ocp.args.StandardSave(to_legacy(state))), force=True)
    mngr.wait_until_finished()
    return ckpt.manager(path)


def test_checkpoint_of_the_per_feature_layout_restores_into_the_nested_one(tmp_path):
    params = mlp_params(0, SIZES)
    ddp = _ddp(accumulate=jddp.Accumulate(steps=2), loss_scale=DynamicScale(init_scale=8.0))
    state = ddp.init(params)
    for i in range(3):  # mid-window: the accumulator holds a partial sum
        state, _ = ddp.step(state, _batch(i))
    legacy = _legacy_checkpoint(tmp_path / "old", state)
    tree = legacy.item_metadata(legacy.latest_step())["default"].tree
    assert {"accum", "loss_scale", "hook_state", "outer"} <= set(tree)
    restored = ckpt.restore(legacy, ddp.abstract_state(params))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # It continues where the run stopped; a new checkpoint is saved in the nested layout.
    ref, _ = ddp.step(state, _batch(3))
    got, _ = ddp.step(restored, _batch(3))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mngr = ckpt.manager(tmp_path / "new")
    saved = ckpt.save(mngr, got)
    assert set(mngr.item_metadata(saved)["default"].tree) == {
        f.name for f in dataclasses.fields(TrainState)}


def test_per_feature_checkpoint_restores_on_another_device_count(tmp_path):
    """The per-device rules hold for the old layout too: the hook's state restarts (a warning),
    the accumulator restores at a window boundary."""
    params = mlp_params(0, SIZES)
    pol = dict(accumulate=jddp.Accumulate(steps=2), loss_scale=DynamicScale(init_scale=8.0))
    ddp8 = _ddp(**pol)
    state = ddp8.init(params)
    for i in range(2):  # a window boundary
        state, _ = ddp8.step(state, _batch(i))
    legacy = _legacy_checkpoint(tmp_path / "old", state)
    ddp4 = _ddp(mesh=jddp.data_mesh(jax.devices()[:4]), **pol)
    with pytest.warns(UserWarning, match="communication hook's per-device state restarts"):
        restored = ckpt.restore(legacy, ddp4.abstract_state(params),
                                init_fn=lambda: ddp4.init(params))
    assert restored.update_state.loss.shape == (4,) and int(restored.update_state.count) == 0
    assert float(restored.update_state.inner.scale) == float(state.update_state.inner.scale)
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
