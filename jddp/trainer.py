"""The data-parallel trainer: ``DataParallel`` and its ``TrainState``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp import buckets as buckets_lib
from jddp import mesh as mesh_lib
from jddp import reduce as reduce_lib
from jddp.hooks import CommHook, allreduce_mean


@struct.dataclass
class TrainState:
    """Everything a training step reads and writes; an immutable pytree.

    Attributes:
      step: number of optimizer updates applied (int32 scalar).
      params: the model parameters, replicated on every device.
      opt_state: the optimizer state, replicated.
      model_state: non-differentiated model state (e.g. Flax ``batch_stats``), or ``None``.
      hook_state: per-device communication-hook state, one entry per parameter leaf, each leaf with
        a leading device dimension (sharded over the data axis).
      accum: local gradient accumulation state, or ``None`` when not accumulating.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None
    hook_state: Any = ()
    accum: Any = None

    if TYPE_CHECKING:  # flax.struct adds ``replace`` at run time; declared for type checkers.

        def replace(self, **updates: Any) -> TrainState: ...


def _state_specs(state: TrainState, axis: str) -> TrainState:
    """Partition specs of a TrainState: replicated, except per-device hook and accumulator state."""
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)
    per_device = lambda tree: jax.tree.map(lambda _: P(axis), tree)
    return TrainState(
        step=P(),  # type: ignore[arg-type]  # a tree of specs shaped like the state
        params=rep(state.params),
        opt_state=rep(state.opt_state),
        model_state=rep(state.model_state),
        hook_state=per_device(state.hook_state),
        accum=per_device(state.accum),
    )


class DataParallel:
    """Data-parallel training of ``loss_fn`` with ``optimizer`` over a 1-D data mesh.

    Parameters are replicated on every device, the global batch is split on its leading dimension,
    each device computes gradients of its shard, and the gradients are averaged across devices in
    size-capped buckets reduced from inside the backward pass (like PyTorch DDP). A step on N
    devices equals a single-device step of ``loss_fn`` on the whole batch.

    Example::

        ddp = jddp.DataParallel(loss_fn, optax.adam(1e-3), mesh=jddp.data_mesh())
        state = ddp.init(params)
        state, metrics = ddp.step(state, batch)   # batch: leading dim = global batch

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss``, the mean loss over its shard of the batch; with
        ``has_aux``, ``(loss, metrics)`` where ``metrics`` is a dict of float scalars (averaged over
        devices and returned with the loss).
      optimizer: an optax ``GradientTransformation``; it sees the averaged gradients, so
        transforms such as ``clip_by_global_norm`` act on the global gradient.
      mesh: the data mesh (default: ``jddp.data_mesh()``, every device).
      bucket_cap_mb: bucket cap in MiB (DDP's default 25).
      first_bucket_mb: cap of the first bucket in MiB (DDP's default 1).
      hook: communication hook for each bucket (default: mean all-reduce).
      bucket_plan: a fixed plan to use instead of planning from the traced use order.
      chain: how buckets are kept apart in the compiled step: ``"auto"`` (``"barrier"`` on GPU,
        ``"add"`` on CPU and TPU; see :func:`jddp.reduce.resolve_chain`), or ``"none"`` to let
        XLA's combiner merge all-reduces as it likes.
      donate: donate the old state's buffers to the new one (default True).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        mesh: Mesh | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        has_aux: bool = False,
        hook: CommHook | None = None,
        bucket_plan: buckets_lib.BucketPlan | None = None,
        chain: str = "auto",
        donate: bool = True,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
            raise TypeError(
                "optimizer must be an optax GradientTransformation (with init and update), got "
                f"{type(optimizer).__name__}."
            )
        cap = buckets_lib.cap_to_bytes(bucket_cap_mb, "bucket_cap_mb")
        first = buckets_lib.cap_to_bytes(first_bucket_mb, "first_bucket_mb")
        if first > cap:
            raise ValueError(
                f"first_bucket_mb ({first_bucket_mb}) is larger than bucket_cap_mb "
                f"({bucket_cap_mb}); the first bucket is meant to be small. Lower first_bucket_mb "
                "or raise bucket_cap_mb."
            )
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.mesh = mesh if mesh is not None else mesh_lib.data_mesh()
        self.axis_name = mesh_lib.mesh_axis(self.mesh)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.first_bucket_mb = float(first_bucket_mb)
        self.has_aux = has_aux
        self.hook = hook or allreduce_mean()
        if chain not in reduce_lib.CHAIN_MODES:
            raise ValueError(f"chain must be one of {reduce_lib.CHAIN_MODES}, got {chain!r}.")
        self.chain = chain
        self._fixed_plan = bucket_plan
        self._last_plan: buckets_lib.BucketPlan | None = None
        self.step = jax.jit(self._step, donate_argnums=(0,) if donate else ())

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def bucket_plan(self) -> buckets_lib.BucketPlan | None:
        """The bucket plan of the most recently traced step (``None`` before the first step)."""
        return self._last_plan

    # ----------------------------------------------------------------------------------- init

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """Builds the replicated initial state: params, optimizer state, hook state, step 0.

        Args:
          params: the initial parameters (floating-point leaves).
          model_state: optional non-differentiated model state (e.g. Flax ``batch_stats``).
        """
        reduce_lib._check_float_params(params)
        if self._fixed_plan is not None:
            self._fixed_plan.check_tree(params)
        shardings = self._state_shardings(jax.eval_shape(self._build_state, params, model_state))
        return jax.jit(self._build_state, out_shardings=shardings)(params, model_state)

    def _build_state(self, params: Any, model_state: Any) -> TrainState:
        n = self.num_devices
        hook_state = reduce_lib.init_hook_state(self.hook, params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.optimizer.init(params),
            model_state=model_state,
            hook_state=jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), hook_state),
            accum=None,
        )

    def _state_shardings(self, abstract_state: TrainState) -> TrainState:
        specs = _state_specs(abstract_state, self.axis_name)
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    def abstract_state(self, params_like: Any, model_state_like: Any = None) -> TrainState:
        """The TrainState ``init`` would build, as ``jax.ShapeDtypeStruct``s with shardings.

        Nothing is allocated or computed, so this works on meshes of compile-only devices.
        """
        abstract = jax.eval_shape(self._build_state, params_like, model_state_like)
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract, self._state_shardings(abstract),
        )

    # ----------------------------------------------------------------------------------- plan

    def plan(self, params: Any, batch: Any) -> buckets_lib.BucketPlan:
        """The bucket plan for ``params`` and a global ``batch`` (arrays or ShapeDtypeStructs)."""
        if self._fixed_plan is not None:
            self._fixed_plan.check_tree(params)
            return self._fixed_plan
        local = _local_batch_shape(batch, self.num_devices)
        fun = self.loss_fn if not self.has_aux else (lambda p, b: self.loss_fn(p, b)[0])
        return buckets_lib.plan_buckets(
            fun,
            params,
            local,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb,
        )

    def _plan_inside(self, params: Any, batch: Any) -> buckets_lib.BucketPlan:
        if self._fixed_plan is not None:
            self._fixed_plan.check_tree(params)
            plan = self._fixed_plan
        else:
            fun = self.loss_fn if not self.has_aux else (lambda p, b: self.loss_fn(p, b)[0])
            plan = buckets_lib.plan_buckets(
                fun,
                params,
                batch,
                bucket_cap_mb=self.bucket_cap_mb,
                first_bucket_mb=self.first_bucket_mb,
            )
        self._last_plan = plan
        return plan

    # ----------------------------------------------------------------------------------- step

    def _check_inputs(self, state: Any, batch: Any) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"step expects the TrainState returned by init (or a previous step), got "
                f"{type(state).__name__}."
            )
        reduce_lib._check_float_params(state.params)
        mesh_lib.check_batch(batch, self.num_devices)

    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        self._check_inputs(state, batch)
        specs = _state_specs(state, self.axis_name)
        sharded = jax.shard_map(
            self._local_step,
            mesh=self.mesh,
            in_specs=(specs, P(self.axis_name)),
            out_specs=(specs, P()),
            check_vma=True,
        )
        return sharded(state, batch)

    def _local_step(self, state: TrainState, batch: Any):
        axis = self.axis_name
        plan = self._plan_inside(state.params, batch)
        hook_state = jax.tree.map(lambda x: x[0], state.hook_state)
        (loss, aux), grads, new_hook_state, metrics = reduce_lib.bucketed_value_and_grad(
            self._loss_with_aux,
            state.params,
            (batch,),
            axis_name=axis,
            plan=plan,
            hook=self.hook,
            hook_state=hook_state,
            step=state.step,
            has_aux=True,
            extras_fn=_metrics_of,
            chain=self.chain,
        )
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            hook_state=jax.tree.map(lambda x: x[None], new_hook_state),
        )
        return new_state, metrics

    def _loss_with_aux(self, params: Any, batch: Any):
        out = self.loss_fn(params, batch)
        if not self.has_aux:
            return out, {}
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                f"With has_aux=True, loss_fn must return (loss, metrics), got {type(out).__name__}."
            )
        return out

    def lower(self, params_like: Any, batch_like: Any, model_state_like: Any = None):
        """Lowers the step that ``step`` runs, from abstract (or concrete) params and batch.

        Args:
          params_like: the params, or ``jax.ShapeDtypeStruct``s of them.
          batch_like: a global batch, or ``jax.ShapeDtypeStruct``s (placed on the data axis if
            they carry no sharding).
          model_state_like: the model state, or its shape structs, if the model has one.

        Returns:
          The ``jax.stages.Lowered`` of ``self.step``; ``.compile().as_text()`` is the compiled
          HLO. With a mesh of compile-only devices (``jddp.testing``) this is the program a GPU or
          TPU cluster would run.
        """
        state = self.abstract_state(params_like, model_state_like)
        sharding = NamedSharding(self.mesh, P(self.axis_name))
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding),
            batch_like,
        )
        return self.step.lower(state, batch)


def _metrics_of(loss: jax.Array, aux: Any) -> dict[str, jax.Array]:
    metrics = {"loss": loss}
    if isinstance(aux, dict):
        for k, v in aux.items():
            if k == "loss":
                raise ValueError("loss_fn's aux metrics must not use the key 'loss'.")
            if jnp.shape(v) != ():
                raise ValueError(
                    f"aux metric {k!r} has shape {jnp.shape(v)}; metrics must be scalars (they "
                    "are averaged over devices)."
                )
            metrics[k] = v
    elif aux is not None and jax.tree.leaves(aux):
        raise TypeError(
            "With has_aux=True, the aux value of loss_fn must be a dict of scalar metrics, got "
            f"{type(aux).__name__}."
        )
    return metrics


def _local_batch_shape(batch: Any, n: int) -> Any:
    def local(x):
        shape = jnp.shape(x)
        return jax.ShapeDtypeStruct((shape[0] // n, *shape[1:]), jnp.result_type(x))

    mesh_lib.check_batch(batch, n)
    return jax.tree.map(local, batch)
