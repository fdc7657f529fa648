"""The place policy (``jddp._src.place.placement``): every placement answers the questions the
step asks (``Place``'s methods), each for where its state lives, and ``ZeRO`` resolves against
the mesh to one placement per stage.
Nothing here compiles; the step programs these answers build are checked by
``scripts/step_programs.py`` and the training tests (test_zero, test_offload, test_hpz)."""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jddp
from jddp._src.place import owned, placement, stages
from jddp._src.step.state import TrainState
from tests._models import mlp_loss


def _methods(cls: type) -> dict[str, list]:
    """Public methods and their parameters (the return type names the class: ``resolve``)."""
    return {name: list(inspect.signature(f).parameters.values()) for name, f in vars(cls).items()
            if not name.startswith("_") and callable(f)}


def _properties(cls: type) -> set[str]:
    return {name for name, f in vars(cls).items() if isinstance(f, property)}


def test_placements_are_the_base_with_its_signatures():
    """Every method the step calls is :class:`Place`'s, with one signature (the step never asks
    which placement it has): ``Replicate`` overrides nothing, each stage only some of them, and
    the user's ``ZeRO`` adds its fields' helper."""
    base = _methods(placement.Place)
    assert not [name for name in vars(placement.Replicate) if not name.startswith("_")]
    for cls in (stages.ZeRO1, stages.ZeRO2, stages.ZeRO3, *owned.STAGES.values()):
        assert issubclass(cls, placement.Place)
        own = _methods(cls)
        assert set(own) <= set(base) and {name: base[name] for name in own} == own
        assert _properties(cls) <= _properties(placement.Place)
    zero = _methods(stages.ZeRO)
    assert set(zero) - set(base) == {"resharding"}
    assert {name: base[name] for name in set(zero) & set(base)} == {
        name: zero[name] for name in set(zero) & set(base)}
    assert jddp.ZeRO is stages.ZeRO and jddp.Replicate is placement.Replicate


@pytest.mark.parametrize("stage,cls,reshard", [(1, stages.ZeRO1, None),
                                               (2, stages.ZeRO2, None),
                                               (3, stages.ZeRO3, True)])
def test_zero_resolves_to_its_stage(stage, cls, reshard):
    given = jddp.ZeRO(stage=stage, hybrid=True, offload=True)
    out = given.resolve(given.topology(jddp.data_mesh(hosts=2)))
    assert type(out) is cls
    assert out.policy == dataclasses.replace(given, reshard_after_forward=reshard)
    # shard="owner" is the same stage's subclass in place/owned.py (no flag read by the stages).
    owner = dataclasses.replace(given, shard="owner")
    out = owner.resolve(owner.topology(jddp.data_mesh(hosts=2)))
    assert type(out) is owned.STAGES[stage] and isinstance(out, cls)
    assert out.policy == dataclasses.replace(owner, reshard_after_forward=reshard)
    # The user's value is untouched: its equality, hash and repr are the fields'.
    assert given == jddp.ZeRO(stage=stage, hybrid=True, offload=True)
    assert hash(given) == hash(jddp.ZeRO(stage=stage, hybrid=True, offload=True))
    assert repr(given) == (f"ZeRO(stage={stage}, reshard_after_forward=None, hybrid=True, "
                           "offload=True, shard='even')")


@pytest.mark.parametrize("place,sharded,typed,grads,pieces", [
    (jddp.Replicate(), False, True, False, False), (jddp.ZeRO(stage=1), True, True, False, False),
    (jddp.ZeRO(stage=2), True, False, True, False), (jddp.ZeRO(stage=3), True, False, True, True)])
def test_what_each_placement_shards(place, sharded, typed, grads, pieces):
    topo = place.topology(jddp.data_mesh())
    resolved = place.resolve(topo)
    for p in (place, resolved):  # the user's value answers as the placement it resolves to
        assert (p.sharded, p.check_vma, p.splits_grads, p.splits_params) == (
            sharded, typed, grads, pieces)
    assert topo.sharded == sharded and topo.shard_count == 8
    assert resolved.topology(jddp.data_mesh()) == topo
    split = P(topo.shard)
    assert resolved.param_spec(topo, (16, 3)) == (split if pieces else P())
    assert resolved.opt_spec(topo, (16, 3)) == (split if sharded else P())
    assert resolved.opt_spec(topo, (3,)) == P()  # no dimension the 8 devices divide: whole


def test_hybrid_shards_inside_each_host():
    place = jddp.ZeRO(stage=3, hybrid=True)
    topo = place.topology(jddp.data_mesh(hosts=2))
    assert topo.shard_count == 4 and topo.replicate == topo.hosts
    assert place.resolve(topo).param_spec(topo, (8,)) == P(topo.local)


@pytest.mark.parametrize("given,resolved", [(None, True), (True, True), (False, False),
                                            (1, False), (8, True), (4, 4)])
def test_zero_resolves_reshard_after_forward_against_the_mesh(given, resolved):
    place = jddp.ZeRO(stage=3, reshard_after_forward=given)
    out = place.resolve(place.topology(jddp.data_mesh()))
    assert out.policy.reshard_after_forward == resolved and type(
        out.policy.reshard_after_forward) is type(resolved)
    assert out.policy.reshard_group == (None if isinstance(resolved, bool) else resolved)
    assert out.resolve(place.topology(jddp.data_mesh())) == out  # idempotent
    below = jddp.ZeRO(stage=2)
    assert below.resolve(below.topology(jddp.data_mesh())).policy is below


def test_config_holds_the_resolved_policy():
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1),
                            place=jddp.ZeRO(stage=3, reshard_after_forward=8))
    assert ddp.config.place == stages.ZeRO3(jddp.ZeRO(stage=3, reshard_after_forward=True))
    assert ddp.policies.place == jddp.ZeRO(stage=3, reshard_after_forward=8)
    assert jddp.DataParallel(mlp_loss, optax.sgd(0.1)).config.place == jddp.Replicate()


def test_offload_keeps_the_optimizer_state_on_the_host_between_steps():
    mesh = jddp.data_mesh()
    leaf = NamedSharding(mesh, P())
    shardings = TrainState(step=leaf, params=leaf, opt_state=(leaf,), model_state=None,
                           reduce_state=None, update_state=None)
    state = TrainState(step=jnp.zeros(()), params=jnp.zeros(()), opt_state=(jnp.zeros(()),),
                       model_state=None, reduce_state=None, update_state=None)
    topo = jddp.ZeRO(stage=1).topology(mesh)
    off, on = (jddp.ZeRO(stage=1, offload=o).resolve(topo) for o in (False, True))
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
