"""``jddp.ZeRO(stage=s, offload=True)``: the optimizer state in host memory between steps.

On the 8 simulated CPU devices the placement is real (the state's arrays carry
``memory_kind="pinned_host"``) while XLA:CPU keeps every memory kind in the same RAM, so the
transfers compile to nothing: training must be bitwise equal to ``offload=False``. The device
memory saving is asserted on the compile-only 8 x H100 program (slow; needs the CUDA compiler
plugin): the device argument bytes fall by exactly the optimizer state's share, which appears as
host argument bytes, moved by ``copy-start``/``copy-done`` pairs.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.core.bytemodel import device_nbytes
from jddp._src.place import offload
from jddp.perf import topologies
from tests._models import layer_list_like, layer_list_loss, mlp_loss, mlp_params, regression_batch

SIZES = [8, 32, 24, 3]  # the last bias (3) stays whole on every device
BUCKETS = jddp.Buckets(cap_mb=0.002, first_mb=0.001)


def _ddp(stage: int, off: bool, **kw):
    return jddp.DataParallel(mlp_loss, optax.adam(1e-2), mesh=jddp.data_mesh(),
                             place=jddp.ZeRO(stage=stage, offload=off), reduce=BUCKETS, **kw)


@functools.cache
def _plain(stage: int, off: bool):
    """``_ddp(stage, off)``, one per configuration for this module: the tests share its compiled
    programs (a new trainer compiles them again)."""
    return _ddp(stage, off)


def _batch(i: int):
    return jddp.shard_batch(regression_batch(i, 32, SIZES[0], SIZES[-1]),
                                   jddp.data_mesh())


def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _train(ddp, steps: int, state=None, start: int = 0):
    state = ddp.init(mlp_params(0, SIZES)) if state is None else state
    for i in range(start, start + steps):
        state, _ = ddp.step(state, _batch(i))
    return state


def _bitwise(a, b) -> None:
    for x, y in zip(_host(a), _host(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_training_is_bitwise_the_device_one(stage):
    """Same parameters and optimizer state after 3 Adam steps; the optimizer state in pinned host
    memory at rest (after init and after every step), the parameters in device memory; replicas
    verified (``ddp.verify`` reads the offloaded state)."""
    ddp = _plain(stage, True)
    state = ddp.init(mlp_params(0, SIZES))
    assert _kinds(state.opt_state) == {offload.HOST}
    assert _kinds(state.params) == {"device"}
    for i in range(3):
        state, metrics = ddp.step(state, _batch(i))
        assert _kinds(state.opt_state) == {offload.HOST}, i
        assert _kinds(state.params) == {"device"}, i
    ddp.verify(state)  # reads the host-memory optimizer state (copied to the devices for it)
    plain = _train(_plain(stage, False), 3)
    _bitwise(state.params, plain.params)
    _bitwise(state.opt_state, plain.opt_state)
    # Split as at the stage: each device holds 1/8 of every split moment.
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim == 2]
    assert moments and all(x.sharding.shard_shape(x.shape)[0] * 8 == x.shape[0]
                           for x in moments)


def test_offload_with_accumulation_and_skip():
    """The update's wrappers (an accumulation window's cond, the non-finite guard's select) run
    on the fetched state: still bitwise, still on the host after a skipped step."""
    opts = dict(accumulate=jddp.Accumulate(steps=2), loss_scale=jddp.SkipNotFinite())
    got, want = _ddp(3, True, **opts), _ddp(3, False, **opts)
    a, b = _train(got, 4), _train(want, 4)
    assert _kinds(a.opt_state) == {offload.HOST}
    _bitwise(a.params, b.params)
    bad = jax.tree.map(lambda x: jnp.asarray(x).at[0, 0].set(jnp.nan), regression_batch(9, 32, 8, 3))
    bad = jddp.shard_batch(bad, jddp.data_mesh())
    before = _host(a.opt_state)
    for _ in range(2):
        a, m = got.step(a, bad)
    assert float(m["skipped"]) == 1.0 and _kinds(a.opt_state) == {offload.HOST}
    for x, y in zip(before, _host(a.opt_state), strict=True):
        np.testing.assert_array_equal(x, y)


def test_checkpoint_restores_into_host_memory_and_resumes(tmp_path):
    """Saved after 2 steps, restored with ``ddp.abstract_state`` (the optimizer state lands in
    host memory), 2 more steps: bitwise the 4 uninterrupted steps. The same checkpoint restores
    into an ``offload=False`` trainer (device memory) and continues to the same bits."""
    from jddp import checkpoint as ckpt

    ddp = _plain(2, True)
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, _train(ddp, 2))
    restored = ckpt.restore(mngr, ddp.abstract_state(mlp_params(0, SIZES)))
    assert _kinds(restored.opt_state) == {offload.HOST}
    assert _kinds(restored.params) == {"device"}
    resumed = _train(ddp, 2, restored, start=2)
    straight = _train(_plain(2, True), 4)
    _bitwise(resumed.params, straight.params)
    _bitwise(resumed.opt_state, straight.opt_state)
    plain = _plain(2, False)
    on_device = ckpt.restore(mngr, plain.abstract_state(mlp_params(0, SIZES)))
    assert _kinds(on_device.opt_state) == {"device"}
    _bitwise(_train(plain, 2, on_device, start=2).params, straight.params)


def test_report_counts_the_optimizer_state_as_host_memory():
    """``ddp.report``: the optimizer state's bytes per device move from ``at_rest`` to
    ``host_at_rest`` (device + host is the ``offload=False`` state), and the text says so."""
    reps = {}
    for off in (False, True):
        ddp = _plain(3, off)
        state = ddp.init(mlp_params(0, SIZES))
        reps[off] = (ddp.report(state, _batch(0)).memory, device_nbytes(state.opt_state),
                     str(ddp.report(state, _batch(0))))
    (dev, opt, _), (host, opt_off, text) = reps[False], reps[True]
    assert opt == opt_off > 0
    assert dev.host_at_rest == 0
    assert host.host_at_rest == opt
    assert host.at_rest == dev.at_rest - opt
    assert re.search(r"host memory per device: at rest", text)


def test_offload_refuses_local_sgd():
    """Local SGD keeps one optimizer state per replica: refused by the compat table's row."""
    with pytest.raises(ValueError, match=r"ZeRO\(offload=True\) moves the optimizer state"):
        jddp.DataParallel(mlp_loss, optax.adam(1e-2), mesh=jddp.data_mesh(hosts=2),
                          place=jddp.ZeRO(stage=2, offload=True),
                          sync=jddp.local_sgd.diloco(2))
    with pytest.raises(TypeError, match="ZeRO.offload must be True or False"):
        jddp.ZeRO(stage=2, offload="yes")


# ----------------------------------------------------------------- compile-only 8 x H100 program

LAYERS, WIDTH, BATCH = 8, 1024, 64


def gpu_program(stage: int, off: bool) -> tuple:
    """(memory_analysis, compiled text, optimizer-state bytes per device) of the 8 x H100 step
    of an 8-layer MLP (width 1024) with Adam."""
    mesh = topologies.gpu_mesh(8)
    ddp = jddp.DataParallel(layer_list_loss, optax.adam(1e-3), mesh=mesh,
                            place=jddp.ZeRO(stage=stage, offload=off))
    params = layer_list_like(LAYERS, WIDTH)
    batch = {k: jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32) for k in ("x", "y")}
    state = ddp.abstract_state(params)
    lowered = ddp.step.lower(state, batch)
    if off:  # compile-only devices drop the memory kind: put it back on those arguments
        topologies.mark_host_arguments(lowered, opt_state_indices(state))
    compiled = lowered.compile()
    return compiled.memory_analysis(), compiled.as_text(), device_nbytes(state.opt_state)


def opt_state_indices(state) -> list[int]:
    """Positions of the optimizer state's leaves among the state's (the step's first argument)."""
    marked = state.replace(opt_state=jax.tree.map(lambda _: "opt", state.opt_state))
    return [i for i, x in enumerate(jax.tree.leaves(marked)) if isinstance(x, str)]


@pytest.mark.slow
@pytest.mark.skipif(not topologies.has_gpu_compiler(), reason="CUDA compiler plugin not installed")
@pytest.mark.parametrize("stage", [1, 3])
def test_h100_device_arguments_fall_by_the_optimizer_state(stage):
    dev, _, opt = gpu_program(stage, False)
    host, text, _ = gpu_program(stage, True)
    assert opt > 2 * 4 * WIDTH * WIDTH * LAYERS // 8  # Adam's two moments, split 8 ways
    assert dev.argument_size_in_bytes - host.argument_size_in_bytes == opt
    assert host.host_argument_size_in_bytes == opt == host.host_output_size_in_bytes
    assert dev.host_argument_size_in_bytes == 0
    # Every leaf goes to the device and back: an async copy pair each way.
    leaves = len(opt_state_indices(gpu_program_state(stage)))
    assert len(re.findall(r"= \(\S+, \S+:S\(5\)\}, u32\[\]\) copy-start", text)) == leaves
    assert len(re.findall(r"= \(\S+:S\(5\)\}, \S+, u32\[\]\) copy-start", text)) == leaves


def gpu_program_state(stage: int):
    ddp = jddp.DataParallel(layer_list_loss, optax.adam(1e-3), mesh=topologies.gpu_mesh(8),
                            place=jddp.ZeRO(stage=stage, offload=True))
    return ddp.abstract_state(layer_list_like(LAYERS, WIDTH))
