"""The place policy (``jddp._src.place.placement``): ``Replicate`` and ``ZeRO`` answer the same
questions the step asks, each for where its state lives, and ``ZeRO`` resolves against the mesh.
Nothing here compiles; the step programs these answers build are checked by
``scripts/step_programs.py`` and the training tests (test_zero, test_offload, test_hpz)."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jddp
from jddp._src.place import placement
from jddp._src.step.state import TrainState
from tests._models import mlp_loss


def _methods(cls: type) -> dict[str, list]:
    """Public methods and their parameters (the return type names the class: ``resolve``)."""
    return {name: list(inspect.signature(f).parameters.values()) for name, f in vars(cls).items()
            if not name.startswith("_") and callable(f)}


def _properties(cls: type) -> set[str]:
    return {name for name, f in vars(cls).items() if isinstance(f, property)}


def test_replicate_and_zero_answer_the_same_questions():
    """Every method the step calls exists on both policies with one signature (the step never
    asks which one it has); ZeRO's extras are its own fields' helpers."""
    rep, zero = _methods(placement.Replicate), _methods(placement.ZeRO)
    assert set(rep) <= set(zero)
    assert {name: zero[name] for name in rep} == rep
    assert set(zero) - set(rep) == {"resharding"}
    assert _properties(placement.Replicate) <= _properties(placement.ZeRO)
    assert jddp.ZeRO is placement.ZeRO and jddp.Replicate is placement.Replicate


@pytest.mark.parametrize("place,sharded,typed,pieces", [
    (jddp.Replicate(), False, True, False), (jddp.ZeRO(stage=1), True, True, False),
    (jddp.ZeRO(stage=2), True, False, False), (jddp.ZeRO(stage=3), True, False, True)])
def test_what_each_placement_shards(place, sharded, typed, pieces):
    topo = place.topology(jddp.data_mesh())
    assert (place.sharded, place.check_vma, place.splits_params) == (sharded, typed, pieces)
    assert topo.sharded == sharded and topo.shard_count == 8
    split = P(topo.shard)
    assert place.param_spec(topo, (16, 3)) == (split if pieces else P())
    assert place.opt_spec(topo, (16, 3)) == (split if sharded else P())
    assert place.opt_spec(topo, (3,)) == P()  # no dimension the 8 devices divide: whole


def test_hybrid_shards_inside_each_host():
    place = jddp.ZeRO(stage=3, hybrid=True)
    topo = place.topology(jddp.data_mesh(hosts=2))
    assert topo.shard_count == 4 and topo.replicate == topo.hosts
    assert place.param_spec(topo, (8,)) == P(topo.local)


@pytest.mark.parametrize("given,resolved", [(None, True), (True, True), (False, False),
                                            (1, False), (8, True), (4, 4)])
def test_zero_resolves_reshard_after_forward_against_the_mesh(given, resolved):
    place = jddp.ZeRO(stage=3, reshard_after_forward=given)
    out = place.resolve(place.topology(jddp.data_mesh()))
    assert out.reshard_after_forward == resolved and type(out.reshard_after_forward) is type(
        resolved)
    assert out.reshard_group == (None if isinstance(resolved, bool) else resolved)
    assert out.resolve(place.topology(jddp.data_mesh())) == out  # idempotent
    below = jddp.ZeRO(stage=2)
    assert below.resolve(below.topology(jddp.data_mesh())) is below


def test_config_holds_the_resolved_policy():
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                            place=jddp.ZeRO(stage=3, reshard_after_forward=8))
    assert ddp.config.place == jddp.ZeRO(stage=3, reshard_after_forward=True)
    assert jddp.DataParallel(mlp_loss, optax.sgd(0.1)).config.place == jddp.Replicate()


def test_offload_keeps_the_optimizer_state_on_the_host_between_steps():
    mesh = jddp.data_mesh()
    leaf = NamedSharding(mesh, P())
    shardings = TrainState(step=leaf, params=leaf, opt_state=(leaf,), model_state=None,
                           hook_state=None, accum=None, loss_scale=None)
    state = TrainState(step=jnp.zeros(()), params=jnp.zeros(()), opt_state=(jnp.zeros(()),),
                       model_state=None, hook_state=None, accum=None, loss_scale=None)
    off, on = jddp.ZeRO(stage=1), jddp.ZeRO(stage=1, offload=True)
    for place in (jddp.Replicate(), off):
        assert place.stored(shardings) is shardings
        assert place.device_view(state) is state
        assert place.fetch(state) is state and place.store(state) is state
    assert on.stored(shardings).opt_state[0].memory_kind == "pinned_host"
    assert on.stored(shardings).params.memory_kind == leaf.memory_kind
    assert on.device_view(state).opt_state is None and on.device_view(state).params is not None


def test_replicate_update_is_optax():
    params = {"w": jnp.ones((4,))}
    grads = {"w": jnp.full((4,), 0.5)}
    opt = optax.sgd(0.1)
    place = jddp.Replicate()
    plan = jddp.plan_buckets(lambda p: jnp.sum(p["w"]), params)
    new, _ = place.update(opt, place.topology(jddp.data_mesh()), None, plan, "none", params,
                          opt.init(params), grads)
    assert jnp.allclose(new["w"], 0.95)
