"""Data-parallel evaluation over a whole data set, with every real example counted exactly once.

:class:`Evaluator` pads the last global batch and masks the padding out of per-device sums (Flax's
``pad_shard_unpad`` without an unpad); one ``psum`` per batch, batches added on the host in
float64. A data set too large for one process goes through a ``jddp.data.Loader``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.data.loader import Loader
from jddp._src.data.uneven import pad_batch
from jddp._src.runtime import mesh as mesh_lib
from jddp._src.step.checks import batch_size as batch_size_of


class Evaluator:
    """Sums of per-example metrics over a data set, data-parallel ([Data](../data.md)).

    Example::

        xent = optax.softmax_cross_entropy_with_integer_labels

        def eval_fn(variables, batch):                      # per example
            logits = model.apply(variables, batch["image"], train=False)
            return {"correct": jnp.argmax(logits, -1) == batch["label"],
                    "loss": xent(logits, batch["label"]),
                    "count": jnp.ones(len(logits))}

        evaluate = jddp.evaluation.Evaluator(eval_fn, mesh=mesh, batch_size=256)
        variables = {"params": state.params, **state.model_state}
        sums = evaluate(variables, {"image": x, "label": y})
        accuracy = sums["correct"] / sums["count"]

    Args:
      eval_fn: ``eval_fn(variables, batch) -> dict[str, array]``, per-example values of a shard.
      mesh: the data mesh (default: ``jddp.data_mesh()``).
      batch_size: the global batch size for host data sets, a multiple of the device count (a
        ``jddp.data.Loader`` brings its own: then it may be left out).
    """

    def __init__(
        self, eval_fn: Callable[[Any, Any], Mapping[str, Any]], *, mesh: Mesh | None = None,
        batch_size: int | None = None,
    ) -> None:
        if not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable, got {type(eval_fn).__name__}.")
        self.mesh = mesh_lib.check_mesh(mesh_lib.data_mesh() if mesh is None else mesh)
        self.axis_name = mesh_lib.mesh_axis(self.mesh)
        n = self.mesh.size
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer)
            or batch_size < 1 or batch_size % n
        ):
            raise ValueError(
                f"batch_size must be a positive multiple of the {n} devices of the mesh, got "
                f"{batch_size!r}."
            )
        self.eval_fn = eval_fn
        self.batch_size = None if batch_size is None else int(batch_size)
        self._replicated = NamedSharding(self.mesh, P())
        self._sums = jax.jit(self._batch_sums)

    def _local_sums(self, variables: Any, batch: Any, mask: jax.Array) -> dict[str, jax.Array]:
        out = self.eval_fn(variables, batch)
        if not isinstance(out, Mapping):
            raise TypeError(
                f"eval_fn must return a dict of per-example arrays, got {type(out).__name__}."
            )
        local = mask.shape[0]
        sums = {}
        for name, value in out.items():
            shape = jnp.shape(value)
            if not shape or shape[0] != local:
                raise ValueError(
                    f"eval_fn's {name!r} has shape {tuple(shape)}; it must hold one value per "
                    f"example of the shard (leading dimension {local}), so that padded examples "
                    "can be left out of the sums. Return per-example values, not means."
                )
            v = jnp.asarray(value, jnp.float32)
            real = mask.reshape((local,) + (1,) * (v.ndim - 1))
            # where(), not a product: a padded example's NaN must not reach the sum.
            sums[str(name)] = jnp.sum(jnp.where(real, v, 0.0))
        return lax.psum(sums, self.axis_name)

    def _batch_sums(self, variables: Any, batch: Any, mask: jax.Array) -> dict[str, jax.Array]:
        return jax.shard_map(
            self._local_sums, mesh=self.mesh, in_specs=(P(), P(self.axis_name), P(self.axis_name)),
            out_specs=P(),
        )(variables, batch, mask)

    def __call__(self, variables: Any, data: Any) -> dict[str, float]:
        """The sums of ``eval_fn``'s values over every example of ``data``.

        Args:
          variables: what ``eval_fn`` takes first, replicated (host arrays are placed).
          data: the whole data set (host arrays, the same on every process), or a
            ``jddp.data.Loader`` at an epoch boundary (one epoch, ``drop_last=False``).
        """
        if isinstance(data, Loader):
            return self._over_loader(variables, data)
        if self.batch_size is None:
            raise ValueError("Evaluator(batch_size=...) is needed to evaluate host arrays (a "
                             "jddp.data.Loader brings its own batch size).")
        total = batch_size_of(data)
        if total == 0:
            raise ValueError("The evaluation data set is empty.")
        variables = jax.tree.map(self._replicate, variables)
        parts = []
        for start in range(0, total, self.batch_size):
            rows = slice(start, start + self.batch_size)
            chunk = jax.tree.map(lambda x, rows=rows: np.asarray(x[rows]), data)
            padded, mask = pad_batch(chunk, self.mesh.size, size=self.batch_size)
            placed = mesh_lib.shard_batch((padded, mask), self.mesh)
            parts.append(self._sums(variables, *placed))
        parts = jax.device_get(parts)
        return {k: float(np.sum([np.float64(p[k]) for p in parts])) for k in parts[0]}

    def _over_loader(self, variables: Any, loader: Loader) -> dict[str, float]:
        if loader.drop_last:
            raise ValueError("The evaluation loader drops its short last batch (drop_last=True): "
                             "those examples would not be counted. Use drop_last=False.")
        inside = loader.position % len(loader)
        if inside:
            raise ValueError(
                f"The evaluation loader is in the middle of an epoch (batch {inside} of "
                f"{len(loader)}); evaluation reads one whole epoch. Use a loader only for "
                "evaluation, or restore it to an epoch boundary."
            )
        if loader.mesh != self.mesh:
            raise ValueError("The evaluation loader's mesh differs from the Evaluator's: build "
                             "both on the same mesh.")
        variables = jax.tree.map(self._replicate, variables)
        everything = mesh_lib.shard_batch(np.ones(loader.global_batch_size, bool), self.mesh)
        parts = []
        for _ in range(len(loader)):
            batch, mask = next(loader)
            parts.append(self._sums(variables, batch, everything if mask is None else mask))
        parts = jax.device_get(parts)
        return {k: float(np.sum([np.float64(p[k]) for p in parts])) for k in parts[0]}

    def _replicate(self, x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x  # a global array of a multi-process run (state.params): already placed
        if isinstance(x, jax.Array) and x.sharding == self._replicated:
            return x
        x = np.asarray(x)  # on every process: each fills only its own devices
        return jax.make_array_from_callback(x.shape, self._replicated, lambda index: x[index])
