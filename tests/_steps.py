"""A hand-written bucketed data-parallel step, for the schedule tests and the XLA flags probe."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jddp.perf.topologies import abstract_like


def mlp_dp_step(
    mesh: Mesh,
    *,
    layers: int = 8,
    width: int = 512,
    batch: int = 256,
    layers_per_bucket: int = 2,
    chain: str | None = "add",
    dtype: Any = np.float32,
) -> tuple[Any, Any, Any]:
    """A hand-written bucketed data-parallel SGD step of a tanh MLP, for schedule tests.

    The reference pattern jddp's trainer follows, written out with ``shard_map``: params are
    replicated (``P()``), the batch is split over the mesh axis, gradients are local
    (``check_vma=False``), and the gradients are reduced per bucket. Buckets take
    ``layers_per_bucket`` layers each in reverse layer order (the order backward produces them);
    a bucket is one ``lax.psum`` over the tuple of its leaves (no concatenation). With ``chain``,
    every leaf of bucket ``i+1`` gets a data dependency on every reduced leaf of bucket ``i``,
    which stops XLA's combiners from merging buckets.

    Args:
        mesh: a 1-D mesh (CPU devices, ``topologies.gpu_mesh`` or ``topologies.tpu_mesh``).
        layers: number of dense layers (each ``width x width`` plus a bias).
        width: layer width.
        batch: global batch size; must divide evenly over the mesh.
        layers_per_bucket: layers per gradient bucket; ``layers / layers_per_bucket`` psums.
        chain: how consecutive buckets are chained: ``"add"`` (``g + 0 * sum(first elements)``),
            ``"barrier"`` (``lax.optimization_barrier((leaves, previous_reduced))``) or ``None``
            (independent psums, which XLA's combiners may merge).
        dtype: parameter and input dtype.

    Returns:
        ``(step, params_like, batch_like)``: the jitted ``step(params, x) -> params`` and
        abstract arguments for ``step.lower(params_like, batch_like)``. ``params`` is a list of
        ``{"b", "w"}`` dicts, one per layer.
    """
    (axis,) = mesh.axis_names
    size = mesh.devices.size

    def loss(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        h = x
        for p in params:
            h = jax.numpy.tanh(h @ p["w"] + p["b"])
        return jax.numpy.mean(h**2)

    def local_step(params: list[dict[str, jax.Array]], x: jax.Array) -> Any:
        grads = jax.grad(loss)(params, x)
        order = list(range(layers))[::-1]
        reduced = list(grads)
        previous: list[jax.Array] = []
        for start in range(0, layers, layers_per_bucket):
            members = order[start : start + layers_per_bucket]
            leaves = [grads[i][k] for i in members for k in ("w", "b")]
            if chain == "add" and previous:
                # A real data dependency on the previous bucket's result; zero in value.
                dep = sum(r.ravel()[0] for r in previous)
                leaves = [g + 0 * dep for g in leaves]
            elif chain == "barrier" and previous:
                # The same dependency without arithmetic that XLA could fuse into the GEMMs
                # producing these gradients: the barrier's outputs depend on all its inputs.
                leaves, _ = jax.lax.optimization_barrier((leaves, previous))
            out = list(jax.lax.psum(tuple(leaves), axis))
            for j, i in enumerate(members):
                reduced[i] = {"w": out[2 * j] / size, "b": out[2 * j + 1] / size}
            previous = out
        return [
            jax.tree.map(lambda p, g: p - 0.1 * g, p, g)
            for p, g in zip(params, reduced, strict=True)
        ]

    step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec(axis)),
            out_specs=PartitionSpec(),
            check_vma=False,
        )
    )
    layer = {"b": np.zeros((width,), dtype), "w": np.zeros((width, width), dtype)}
    params_like = abstract_like([layer] * layers, mesh)
    batch_like = abstract_like(np.zeros((batch, width), dtype), mesh, PartitionSpec(axis))
    return step, params_like, batch_like
