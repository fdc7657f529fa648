"""The update wrappers of jddp/_src/update/update.py as values: the rule for whether a call updates
(the host's next ``state.step`` and phase 3 read the same one), the accumulation window's
per-device decisions, and the composition a DataParallel builds from its policies."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.api import policies
from jddp._src.step.state import AccumState
from jddp._src.update.nonfinite import SkipNotFinite
from jddp._src.update.update import Accumulate, Update
from tests._models import mlp_loss


@pytest.mark.parametrize("update, sync, runs", [
    (Update(), None, True),
    (Update(), True, True),
    (Update(accumulate=Accumulate(steps=4)), False, False),
    (Update(accumulate=Accumulate(steps=4)), None, None),  # the window's counter decides
    (Update(accumulate=Accumulate(steps=4)), True, True),
    (Update(accumulate=Accumulate(microbatches=4)), None, True),  # no window: every call
    (Update(guard=SkipNotFinite()), None, None),  # a guard decides on the device
    (Update(guard=jddp.precision.DynamicScale()), True, None),
    (Update(skip_empty=True), None, None),  # an empty weighted window is skipped
    (Update(accumulate=Accumulate(steps=2), guard=SkipNotFinite()), False, False),
])
def test_whether_a_call_updates_is_one_rule(update, sync, runs):
    assert update.runs(sync) is runs
    expected = None if runs is None else 7 + int(runs)
    assert update.following(7, sync) == expected


def test_skips_and_the_nested_update_state():
    assert not Update().skips and Update().init(None) is None
    assert Update(guard=SkipNotFinite()).skips
    assert Update(guard=SkipNotFinite()).init(None) is None  # no state of its own
    scale = Update(guard=jddp.precision.DynamicScale(init_scale=8.0)).init(None)
    assert float(scale.scale) == 8.0 and int(scale.fin_steps) == 0 and scale.inner is None
    # The window's state nests the guard's (optax's inner_state); each reads its own node.
    both = Update(accumulate=Accumulate(steps=2), guard=jddp.precision.DynamicScale())
    acc = both.accumulate.init({"w": jnp.zeros(3)}, 8)
    chain = both.init(acc)
    assert chain.inner.scale is both.guard_state(chain).scale and both.guard_state(chain).inner is None
    assert both.window(chain).count is chain.count and both.window(chain).inner is None
    assert Update.window(scale) is None and Update.guard_state(acc) is None


def test_the_window_decides_per_call():
    acc = Accumulate(steps=3, microbatches=2)
    state = AccumState(count=jnp.int32(1), grads=None, loss=None, weight=None)
    assert acc.synchronises(None, None) is True
    assert acc.synchronises(state, True) is True
    assert acc.synchronises(state, False) is False
    assert not bool(acc.synchronises(state, None))  # call 2 of 3
    assert bool(acc.synchronises(state.replace(count=jnp.int32(2)), None))  # call 3 closes
    assert float(acc.window_count(state)) == 4.0 and acc.window_count(None) == 2.0
    assert acc.calls(None) == 3 and acc.calls(True) == 1
    assert acc.reducing(None) is True and Accumulate().reducing(False) is False
    assert not acc.is_identity and Accumulate().is_identity
    assert Accumulate(steps=2).init({"w": jnp.zeros(3)}, 8).grads["w"].shape == (8, 3)
    assert Accumulate(steps=2, shard=True).init({"w": jnp.zeros(3)}, 8).grads["w"].shape == (3,)
    assert Accumulate().init({"w": jnp.zeros(3)}, 8) is None


@pytest.mark.parametrize("m", [1, 3])
def test_microbatch_split(m):
    batch = {"x": np.arange(6 * 2).reshape(6, 2)}
    acc = Accumulate(microbatches=m)
    micro, last = acc.split(batch)
    assert micro["x"].shape == (m, 6 // m, 2)
    np.testing.assert_array_equal(last["x"], batch["x"][6 - 6 // m:])
    assert acc.head(micro)["x"].shape == (m - 1, 6 // m, 2)
    assert acc.scans is (m > 1)


def test_data_parallel_composes_its_update():
    """The public policies are the wrappers: ``shard`` resolved, the guard as given, a weighted
    loss's empty window skipped; ``jddp.Accumulate`` and ``jddp.SkipNotFinite`` are the classes
    of jddp/_src/update/update.py (policies.py re-exports them)."""
    assert jddp.Accumulate is policies.Accumulate is Accumulate
    assert jddp.SkipNotFinite is policies.SkipNotFinite is SkipNotFinite
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1), place=jddp.ZeRO(stage=2),
                            accumulate=jddp.Accumulate(steps=2), loss_scale=jddp.SkipNotFinite(),
                            loss=jddp.Loss(weighted=True))
    update = ddp.config.update
    assert update.accumulate == jddp.Accumulate(steps=2, shard=True) == ddp.config.accumulate
    assert update.guard == jddp.SkipNotFinite() and update.skip_empty
