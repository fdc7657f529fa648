"""Flax NNX support: data-parallel training of an ``nnx.Module``.

NNX models are objects; jddp's core works on pure functions of pytrees. The bridge is NNX's own
functional API: ``nnx.split(model, nnx.Param, ...)`` gives a static ``graphdef``, the ``Param``
state (what is differentiated, reduced and optimised) and the rest (batch statistics, RNG keys and
counts); ``nnx.merge`` rebuilds the model from them inside the step.

Two entry points:

- :class:`DataParallel` -- the NNX counterpart of :class:`jddp.DataParallel`, for a
  ``loss_fn(model, batch)``. Non-``Param`` state that the forward pass changes (BatchNorm
  statistics, RNG counts) is carried in ``TrainState.model_state``, identical on every device.
- :func:`wrap` -- turns a model and a ``loss_fn(model, batch)`` into a pure
  ``loss(params, batch)`` plus the ``Param`` state, for :class:`jddp.DataParallel`,
  :func:`jddp.value_and_grad` or your own ``shard_map``. The non-``Param`` state is frozen into the
  function, so it suits models whose forward pass changes no state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp import buckets as buckets_lib
from jddp import mesh as mesh_lib
from jddp import reduce as reduce_lib
from jddp import trainer as trainer_lib
from jddp.hooks import CommHook, allreduce_mean

__all__ = ["DataParallel", "wrap"]


def _split(model: nnx.Module, wrt: Any) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, wrt_state, rest)``: ``nnx.split`` with exactly two filters."""
    graphdef, params, rest = nnx.split(model, wrt, ...)  # type: ignore[misc]
    return graphdef, params, rest


def wrap(
    model: nnx.Module,
    loss_fn: Callable[..., Any],
    *,
    wrt: Any = nnx.Param,
) -> tuple[Callable[..., Any], nnx.State, nnx.State]:
    """A pure loss over the ``wrt`` state of an NNX model, for the functional jddp API.

    Example::

        loss, params, _ = jddp.nnx.wrap(model, lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean())
        ddp = jddp.DataParallel(loss, optax.adam(1e-3))
        state = ddp.init(params)
        ...
        nnx.update(model, state.params)    # write the trained parameters back into the model

    Args:
      model: the NNX module.
      loss_fn: ``loss_fn(model, *args)`` returning the loss (or ``(loss, aux)``); the returned
        function passes its extra arguments through, so ``has_aux`` is up to the caller.
      wrt: the NNX filter of the differentiated state (default ``nnx.Param``).

    Returns:
      ``(loss_over_params, params, rest)``: ``loss_over_params(params, *args)`` merges the model
      from ``params`` and the ``rest`` state captured now, and calls ``loss_fn``. Changes that the
      forward pass makes to the non-``wrt`` state are discarded; use :class:`DataParallel` for
      models with BatchNorm statistics or dropout RNG streams.
    """
    graphdef, params, rest = _split(model, wrt)

    def loss_over_params(params: nnx.State, *args: Any) -> Any:
        return loss_fn(nnx.merge(graphdef, params, rest), *args)

    return loss_over_params, params, rest


class DataParallel:
    """Data-parallel training of an NNX model: ``loss_fn(model, batch)`` with an optax optimizer.

    The ``wrt`` state (``nnx.Param`` by default) is replicated; each device merges the model,
    computes the loss on its shard of the batch, and gradients are averaged in buckets from inside
    the backward pass, exactly as in :class:`jddp.DataParallel`. The optimizer is plain optax on the
    ``Param`` state, so it sees the globally averaged gradient. A step on N devices equals a
    single-device ``nnx.Optimizer`` step on the whole batch for models whose forward pass is
    per-example (no BatchNorm in training mode).

    Non-``wrt`` state written by the forward pass is synchronised after each step: floating-point
    leaves that differ between devices (BatchNorm running statistics) are averaged over the data
    axis, the local analogue of DDP broadcasting buffers; leaves that stay identical (RNG keys and
    counts, derived from replicated values) are kept as they are. Dropout masks therefore repeat
    across devices, as in a DDP job whose ranks share one seed.

    Example::

        model = MLP(rngs=nnx.Rngs(0))
        ddp = jddp.nnx.DataParallel(model, optax.adam(1e-3),
                                    loss_fn=lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean())
        state = ddp.init()
        for batch in batches:
            state, metrics = ddp.step(state, batch)
        ddp.update(model, state)          # or: trained = ddp.merge(state)

    Args:
      model: the NNX module; only its structure (``graphdef``) is kept, its values are read by
        :meth:`init`.
      optimizer: an optax ``GradientTransformation`` over the ``wrt`` state.
      loss_fn: ``loss_fn(model, batch) -> loss``, the mean loss over the batch shard; with
        ``has_aux``, ``(loss, metrics)`` with a dict of float scalar metrics.
      wrt: the NNX filter of the trained state (default ``nnx.Param``).
      mesh, bucket_cap_mb, first_bucket_mb, hook, donate: as for :class:`jddp.DataParallel`.
      has_aux: whether ``loss_fn`` returns ``(loss, metrics)``.

    Attributes:
      step: the jitted step, ``step(state, batch) -> (state, metrics)``; ``batch`` has the global
        batch as leading dimension, ``metrics["loss"]`` is the loss averaged over devices.
      graphdef: the model's static structure (``nnx.graphdef(model)``).
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable[..., Any],
        *,
        wrt: Any = nnx.Param,
        has_aux: bool = False,
        mesh: Mesh | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        hook: CommHook | None = None,
        donate: bool = True,
    ) -> None:
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"model must be a flax.nnx.Module, got {type(model).__name__}. For Linen or plain "
                "pytrees of parameters use jddp.DataParallel."
            )
        self.graphdef = nnx.graphdef(model)
        self.wrt = wrt
        self.loss_fn = loss_fn
        self.has_aux = has_aux
        self._model = model
        # The core trainer builds the state (replicated params, optimizer and hook state) and holds
        # the settings; the step is our own because the loss also reads and writes model state.
        self._core = trainer_lib.DataParallel(
            self._core_loss, optimizer, mesh=mesh, bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb, hook=hook or allreduce_mean(), donate=donate,
        )
        self.optimizer = optimizer
        self.mesh = self._core.mesh
        self.axis_name = self._core.axis_name
        self.hook = self._core.hook
        self._last_plan: buckets_lib.BucketPlan | None = None
        self.step = jax.jit(self._step, donate_argnums=(0,) if donate else ())

    @property
    def num_devices(self) -> int:
        """The number of devices of the data mesh (replicas)."""
        return self.mesh.size

    @property
    def bucket_plan(self) -> buckets_lib.BucketPlan | None:
        """The bucket plan of the most recently traced step (``None`` before the first step)."""
        return self._last_plan

    def _core_loss(self, params: Any, batch: Any) -> Any:
        raise NotImplementedError("internal: jddp.nnx.DataParallel runs its own step")

    def split(self, model: nnx.Module | None = None) -> tuple[nnx.State, nnx.State]:
        """``(params, rest)`` of ``model`` (default: the model given at construction)."""
        model = self._model if model is None else model
        graphdef, params, rest = _split(model, self.wrt)
        if graphdef != self.graphdef:
            raise ValueError("model does not have the structure of the model this was built with.")
        return params, rest

    def init(self, model: nnx.Module | None = None) -> trainer_lib.TrainState:
        """The replicated initial state from ``model``'s current values (default: the model given
        at construction): ``params`` is its ``wrt`` state, ``model_state`` the rest."""
        params, rest = self.split(model)
        return self._core.init(params, model_state=rest)

    def merge(self, state: trainer_lib.TrainState) -> nnx.Module:
        """A new model with the parameters and model state of ``state``."""
        return nnx.merge(self.graphdef, state.params, state.model_state)

    def update(self, model: nnx.Module, state: trainer_lib.TrainState) -> None:
        """Writes the parameters and model state of ``state`` into ``model`` in place."""
        nnx.update(model, state.params, state.model_state)

    def lower(self, state: Any, batch: Any) -> jax.stages.Lowered:
        """Lowers the step for ``state`` and ``batch`` (arrays or ``jax.ShapeDtypeStruct``s)."""
        return self.step.lower(state, batch)

    # ----------------------------------------------------------------------------------- step

    def _loss(self, params: nnx.State, rest: nnx.State, batch: Any) -> tuple[jax.Array, Any]:
        model = nnx.merge(self.graphdef, params, rest)
        out = self.loss_fn(model, batch)
        if self.has_aux:
            if not isinstance(out, tuple) or len(out) != 2:
                raise TypeError(
                    "With has_aux=True, loss_fn must return (loss, metrics), got "
                    f"{type(out).__name__}."
                )
            loss, metrics = out
        else:
            loss, metrics = out, {}
        _, _, new_rest = _split(model, self.wrt)
        return loss, (metrics, new_rest)

    def _step(self, state: trainer_lib.TrainState, batch: Any):
        if not isinstance(state, trainer_lib.TrainState):
            raise TypeError(
                f"step expects the TrainState returned by init, got {type(state).__name__}."
            )
        reduce_lib._check_float_params(state.params)
        mesh_lib.check_batch(batch, self.num_devices)
        specs = trainer_lib._state_specs(state, self.axis_name)
        sharded = jax.shard_map(
            self._local_step,
            mesh=self.mesh,
            in_specs=(specs, P(self.axis_name)),
            out_specs=(specs, P()),
            check_vma=True,
        )
        return sharded(state, batch)

    def _local_step(self, state: trainer_lib.TrainState, batch: Any):
        axis = self.axis_name
        rest = state.model_state

        def value_only(params, rest, batch):
            return self._loss(params, rest, batch)[0]

        plan = buckets_lib.plan_buckets(
            value_only, state.params, rest, batch,
            bucket_cap_mb=self._core.bucket_cap_mb, first_bucket_mb=self._core.first_bucket_mb,
        )
        self._last_plan = plan
        hook_state = jax.tree.map(lambda x: x[0], state.hook_state)
        (_, (_, new_rest)), grads, new_hook_state, metrics = reduce_lib.bucketed_value_and_grad(
            self._loss,
            state.params,
            (rest, batch),
            axis_name=axis,
            plan=plan,
            hook=self.hook,
            hook_state=hook_state,
            step=state.step,
            has_aux=True,
            extras_fn=lambda loss, aux: trainer_lib._metrics_of(loss, aux[0]),
        )
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=_sync_model_state(new_rest, axis),
            hook_state=jax.tree.map(lambda x: x[None], new_hook_state),
        )
        return new_state, metrics


def _sync_model_state(rest: Any, axis_name: Any) -> Any:
    """Makes the non-trained state identical on every device (see :class:`DataParallel`)."""

    def sync(path, x):
        if axis_name not in reduce_lib._varying_axes(x):
            return x
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return lax.pmean(x, axis_name)
        raise TypeError(
            f"Model state {buckets_lib.key_path_str(path)} ({jnp.result_type(x)}) depends on the "
            "batch shard, so it differs between devices, and is not floating point, so it cannot "
            "be averaged. Compute it from replicated values, or keep it out of the model."
        )

    return jax.tree_util.tree_map_with_path(sync, rest)
