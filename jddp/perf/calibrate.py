"""Measuring the inputs of the cost model on the current machine."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp._src.plan.planner import backward_sizes
from jddp._src.runtime import mesh as mesh_lib
from jddp._src.step import skeleton
from jddp.perf.costmodel import Link, ModelProfile
from jddp.random import example_keys

__all__ = [
    "AllReduceFit",
    "alternate_medians",
    "alternate_samples",
    "fit_link",
    "measure_allreduce",
    "profile_step",
]


def alternate_samples(
    fns: dict[str, Callable[[], Any]], *, repeats: int = 5, warmup: int = 1
) -> dict[str, list[float]]:
    """Wall times (s) of each zero-argument function, run round-robin so drift hits all alike.

    Each function is called ``warmup`` times first (compilation, allocator warm-up), then the
    functions are called in turn ``repeats`` times each, each call ended by
    ``jax.block_until_ready``. Sample ``i`` of every function comes from the same round.
    """
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            samples[name].append(time.perf_counter() - t0)
    return samples


def alternate_medians(
    fns: dict[str, Callable[[], Any]], *, repeats: int = 5, warmup: int = 1
) -> dict[str, float]:
    """Median wall time (s) of each function, measured by :func:`alternate_samples`."""
    samples = alternate_samples(fns, repeats=repeats, warmup=warmup)
    return {k: float(np.median(v)) for k, v in samples.items()}


class AllReduceFit(NamedTuple):
    """An alpha-beta fit of measured all-reduce times on ``num_devices`` devices.

    Attributes:
      link: the fitted link: ``ring_allreduce_time(b, num_devices, link)`` reproduces the fit
        ``intercept_s + b * slope_s_per_byte``.
      intercept_s: fitted time of an empty all-reduce.
      slope_s_per_byte: fitted seconds per byte.
      sizes: bytes per device of each measured all-reduce.
      times: measured seconds of each all-reduce (median).
      num_devices: devices in the all-reduce.
    """

    link: Link
    intercept_s: float
    slope_s_per_byte: float
    sizes: tuple[int, ...]
    times: tuple[float, ...]
    num_devices: int

    def predict(self, nbytes: float) -> float:
        return self.intercept_s + nbytes * self.slope_s_per_byte


def fit_link(sizes: Sequence[int], times: Sequence[float], n: int) -> AllReduceFit:
    """Fits measured all-reduce times to the alpha-beta model of a ring all-reduce.

    Args:
      sizes: bytes per device of each all-reduce.
      times: seconds of each all-reduce.
      n: devices in the all-reduce.

    Returns:
      The fit: its link reproduces ``intercept + bytes * slope``, a least-squares line weighted
      by ``1/time`` (clipped to a non-negative intercept and a positive slope).
    """
    x = np.asarray(sizes, float)
    y = np.asarray(times, float)
    # Relative (1/t-weighted) least squares: small all-reduces matter as much as large ones, so the
    # latency term is not swamped by the largest sizes.
    w = 1.0 / np.maximum(y, 1e-9)
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (intercept, slope), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    intercept = max(float(intercept), 0.0)
    slope = max(float(slope), 1e-18)
    steps = 2.0 * (n - 1)
    link = Link(bandwidth=steps / n / slope, latency=intercept / steps)
    return AllReduceFit(link, intercept, slope, tuple(int(s) for s in sizes),
                        tuple(float(t) for t in times), n)


def measure_allreduce(
    mesh: Mesh | None = None,
    sizes_bytes: Sequence[int] = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20),
    *,
    chain: int = 4,
    repeats: int = 7,
    dtype: Any = jnp.float32,
) -> AllReduceFit:
    """Times ``psum`` of several sizes on ``mesh`` and fits the alpha-beta model.

    Each size is timed as the difference between a program with ``chain + 1`` dependent psums and
    one with a single psum, divided by ``chain``: this removes the dispatch and transfer cost of a
    jitted call, which the all-reduces inside a training step do not pay. Consecutive psums are
    made dependent (and device-varying, by adding the input back) so that XLA can neither combine
    them nor replace them with a multiplication.

    Args:
      mesh: a 1-D data mesh (default: every device).
      sizes_bytes: bytes per device of each timed all-reduce.
      chain: extra psums in the long program.
      repeats: alternated repetitions per program.
      dtype: element type reduced.

    Returns:
      The fit, with the measured points.
    """
    mesh = mesh if mesh is not None else mesh_lib.data_mesh()
    axis = mesh_lib.mesh_axis(mesh)
    n = mesh.size
    itemsize = np.dtype(dtype).itemsize

    def program(k: int) -> Callable[[jax.Array], jax.Array]:
        def body(x):
            y = x
            for _ in range(k):
                y = lax.psum(y, axis) + x
            return y

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                                     check_vma=False))

    short, long = program(1), program(chain + 1)
    times = []
    for size in sizes_bytes:
        x = jnp.ones((n, max(1, int(size) // itemsize)), dtype)
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(axis)))
        runs: dict[str, Callable[[], Any]] = {
            "short": functools.partial(short, x), "long": functools.partial(long, x)
        }
        smp = alternate_samples(runs, repeats=repeats)
        # Median of the per-round differences: both programs of a round saw the same load.
        diff = float(np.median(np.subtract(smp["long"], smp["short"]))) / chain
        times.append(max(diff, 1e-7))
    return fit_link(sizes_bytes, times, n)


def profile_step(
    ddp: Any,
    state: Any,
    batch: Any,
    *,
    repeats: int = 5,
    leaf_weights: Sequence[float] | None = None,
) -> ModelProfile:
    """Measures one device's compute of a :class:`jddp.DataParallel` step, with no communication.

    Three programs run the step's local work on every device of ``ddp.mesh`` with no collective
    at all (``shard_map`` with ``check_vma=False``, gradients left local): the forward pass, the
    forward and backward pass, and the whole local step with the optimizer update. Their
    differences give forward, backward and optimizer time. The backward time is spread over the
    parameter leaves in proportion to ``leaf_weights`` (default: leaf size, exact for dense layers
    on a fixed batch) and the leaves are ordered as the step's bucket plan orders them (the order
    the backward produces gradients).

    Args:
      ddp: the DataParallel trainer (its public ``loss_fn``, ``has_aux``, ``optimizer`` and
        ``mesh`` are used); its loss must be stateless, ``loss_fn(params, batch)``.
      state: a TrainState from ``ddp.init``.
      batch: a global batch.
      repeats: alternated repetitions per program.
      leaf_weights: optional backward cost weight per leaf, in ``jax.tree.leaves`` order.

    Returns:
      A profile whose times are per step as seen by one device (on simulated devices: the wall
      time of all of them sharing the host's cores).
    """
    params = state.params
    plan = ddp.plan(params, batch)
    f0, f1, f2 = _local_programs(ddp)
    med = alternate_medians(
        {
            "fwd": lambda: f0(params, batch),
            "fwd_bwd": lambda: f1(params, batch),
            "step": lambda: f2(params, state.opt_state, batch),
        },
        repeats=repeats,
    )
    forward = med["fwd"]
    backward = max(med["fwd_bwd"] - forward, 0.0)
    optimizer = max(med["step"] - med["fwd_bwd"], 0.0)

    order = [i for b in plan.buckets for i in b.indices]
    sizes, _ = backward_sizes(plan)
    weights = (
        [float(leaf_weights[i]) for i in order] if leaf_weights is not None else
        [float(s) for s in sizes]
    )
    total = sum(weights) or 1.0
    return ModelProfile(
        nbytes=tuple(sizes),
        backward_s=tuple(backward * w / total for w in weights),
        forward_s=forward,
        optimizer_s=optimizer,
        dtypes=tuple(plan.dtypes[i] for i in order),
        names=tuple(plan.paths[i] for i in order),
    )


def _local_programs(ddp: Any) -> tuple[Any, Any, Any]:
    """``ddp``'s forward, forward and backward, and whole local step (with the update), each
    jitted over every device of its mesh with no collective (gradients left local)."""
    mesh, axis = ddp.mesh, ddp.axis_name
    # The loss exactly as the step differentiates it (the pipeline's objective), without metrics.
    objective = skeleton.objective(ddp.config, stateful=False)

    def loss(p, b):
        # With rng=True the loss takes per-example keys: any keys cost the same.
        keys = None
        if ddp.config.loss.rng:
            keys = example_keys(jax.random.key(0), 0, jax.tree.leaves(b)[0].shape[0])
        return objective(p, None, b, None, keys)[0]

    def fwd_bwd(p, b):
        return jax.value_and_grad(loss)(p, b)

    def local_step(p, o, b):
        value, grads = jax.value_and_grad(loss)(p, b)
        updates, o = ddp.optimizer.update(grads, o, p)
        return value, jax.tree.map(lambda a, u: a + u, p, updates), o

    def local(fn, n_rep):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * n_rep + (P(axis),),
                                     out_specs=P(), check_vma=False))

    return local(loss, 1), local(fwd_bwd, 1), local(local_step, 2)
