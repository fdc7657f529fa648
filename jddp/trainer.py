"""The data-parallel trainer: ``DataParallel`` and its ``TrainState``."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp import accumulate as accum_lib
from jddp import buckets as buckets_lib
from jddp import hooks as hooks_lib
from jddp import mesh as mesh_lib
from jddp import model_state as ms_lib
from jddp import nonfinite as nonfinite_lib
from jddp import reduce as reduce_lib
from jddp import uneven as uneven_lib
from jddp import unused as unused_lib
from jddp import verify as verify_lib
from jddp._src import watchdog as watchdog_lib
from jddp.hooks import CommHook, allreduce_mean
from jddp.objective import Objective


@struct.dataclass
class TrainState:
    """Everything a training step reads and writes; an immutable pytree.

    Attributes:
      step: number of optimizer updates applied (int32 scalar).
      params: the model parameters, replicated on every device.
      opt_state: the optimizer state, replicated.
      model_state: non-differentiated model state (e.g. Flax ``batch_stats``), or ``None``;
        replicated, except with ``model_state_sync="none"``: one copy per device (leading device
        dimension, like ``hook_state``).
      hook_state: per-device communication-hook state, one entry per parameter leaf, each leaf with
        a leading device dimension (sharded over the data axis).
      accum: local gradient accumulation state (and each device's model state inside a window),
        or ``None`` when not accumulating.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None
    hook_state: Any = ()
    accum: Any = None

    if TYPE_CHECKING:  # flax.struct adds ``replace`` at run time; declared for type checkers.

        def replace(self, **updates: Any) -> TrainState: ...


def _state_specs(state: TrainState, axis: str, per_device_model_state: bool = False) -> TrainState:
    """Partition specs of a TrainState: replicated, except per-device hook and accumulator state
    (and model state with ``model_state_sync="none"``)."""
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)
    per_device = lambda tree: jax.tree.map(lambda _: P(axis), tree)
    return TrainState(
        step=P(),  # type: ignore[arg-type]  # a tree of specs shaped like the state
        params=rep(state.params),
        opt_state=rep(state.opt_state),
        model_state=(per_device if per_device_model_state else rep)(state.model_state),
        hook_state=per_device(state.hook_state),
        accum=accum_lib.accum_specs(state.accum, axis),
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
        devices and returned with the loss). When ``init`` is given ``model_state``:
        ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``, or with ``has_aux``
        ``(loss, (new_model_state, metrics))``. With ``weighted``, ``loss`` is the vector of
        per-example losses of the shard. See ``jddp.objective`` and docs/model_state.md.
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
      model_state_sync: how new model state is made consistent across replicas: ``"broadcast"``
        (replica 0's, bit-exact; DDP's ``broadcast_buffers``), ``"mean"`` (averaged; integer leaves
        broadcast) or ``"none"`` (one state per replica). No extra collective: it rides on the last
        bucket's all-reduce.
      weighted: ``loss_fn`` returns per-example losses and ``step`` takes an optional ``mask`` (or
        per-example weights); the step averages over real examples only (uneven final batches,
        see ``jddp.pad_batch``).
      keep_unused: keep parameters without a gradient path to the loss in the buckets (by
        default they are left out, with a one-time warning naming them, and get zero gradients).
      skip_nonfinite: skip the update (params, optimizer, model and hook state, ``state.step``)
        when the reduced gradient has a NaN or Inf; ``metrics["skipped"]`` is 1.0 for a skipped
        step, else 0.0. With accumulation the decision is taken on the synchronising call, on the
        whole window's reduced gradient; a skipped window is still consumed (the accumulator
        restarts empty) and no-sync calls report 0.0.
      compiler_options: XLA options for compiling the step (``jax.jit(compiler_options=...)``),
        e.g. ``jddp.xla_flags.recommended("gpu", cap).compiler_options`` for GPU bucket caps above
        about 29 MiB, where XLA's GPU combiner would otherwise split a bucket.
      accumulate_steps: ``k > 1`` accumulates local gradients over ``k`` calls of ``step`` and
        reduces once, on the ``k``-th (DDP's ``no_sync``); ``step(state, batch, sync=...)``
        chooses explicitly. Combines with model state (updated locally per micro-batch, synchronised
        on the synchronising call) and ``skip_nonfinite``, not with ``weighted``. See
        :mod:`jddp.accumulate`.
      microbatches: ``m > 1`` splits each device's batch into ``m`` micro-batches scanned inside
        one step, with one reduction per bucket after the loop.
      accum_dtype: dtype of the local gradient sums (default float32, or the parameter dtype if
        wider).
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
        model_state_sync: str = "broadcast",
        weighted: bool = False,
        keep_unused: bool = False,
        skip_nonfinite: bool = False,
        compiler_options: dict[str, Any] | None = None,
        accumulate_steps: int = 1,
        microbatches: int = 1,
        accum_dtype: Any = None,
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
        self.model_state_sync = ms_lib.check_sync_mode(model_state_sync)
        self.weighted = bool(weighted)
        self.keep_unused = bool(keep_unused)
        self.skip_nonfinite = bool(skip_nonfinite)
        self._warned_unused = False
        self.accumulate_steps, self.microbatches, self.accum_dtype = accum_lib.check_options(
            accumulate_steps, microbatches, accum_dtype
        )
        if self._accumulating and self.weighted:
            # The weighted mean needs the real-example count of the whole window, which a no-sync
            # call cannot know without a collective.
            raise ValueError(
                "accumulate_steps/microbatches cannot be combined with weighted=True yet; use one "
                "or the other."
            )
        # ``sync`` (accumulation, see jddp.accumulate) and ``phase`` (hooks whose collectives change
        # with the step, see jddp.hooks) are static: each value is its own compiled variant.
        self.compiler_options = dict(compiler_options or {})
        self._jit_step = jax.jit(
            self._step,
            donate_argnums=(0,) if donate else (),
            static_argnames=("sync", "phase"),
            compiler_options=self.compiler_options or None,
        )
        # With the default hook, ``step`` is the jitted function itself.
        self.step = (
            self._jit_step if getattr(self.hook, "phase", None) is None else _PhasedStep(self)
        )
        # Issue #16, interim: report completed steps to jddp-run's watchdog (a no-op wrapper
        # outside jddp-run). The new core's step object calls report_progress itself instead.
        self.step = watchdog_lib.reporting(self.step)

    @property
    def _accumulating(self) -> bool:
        return self.accumulate_steps > 1 or self.microbatches > 1

    @property
    def _per_device_ms(self) -> bool:
        return self.model_state_sync == "none"

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
        ms_lib.check_model_state(model_state, self.model_state_sync)
        # DDP's init_sync: every process starts from process 0's values (no-op with one process).
        params, model_state = verify_lib.sync_from_process0((params, model_state), "params")
        shardings = self._state_shardings(jax.eval_shape(self._build_state, params, model_state))
        return jax.jit(self._build_state, out_shardings=shardings)(params, model_state)

    def _build_state(self, params: Any, model_state: Any) -> TrainState:
        n = self.num_devices
        hook_state = reduce_lib.init_hook_state(self.hook, params)
        to_devices = lambda tree: jax.tree.map(
            lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree
        )
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.optimizer.init(params),
            # With model_state_sync="none" each replica keeps its own copy.
            model_state=to_devices(model_state) if self._per_device_ms else model_state,
            hook_state=to_devices(hook_state),
            accum=accum_lib.init_accum(params, n, self.accum_dtype, model_state)
            if self.accumulate_steps > 1
            else None,
        )

    def _state_shardings(self, abstract_state: TrainState) -> TrainState:
        specs = _state_specs(abstract_state, self.axis_name, self._per_device_ms)
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

    def plan(
        self, params: Any, batch: Any, model_state: Any = None, mask: Any = None
    ) -> buckets_lib.BucketPlan:
        """The bucket plan for ``params`` and a global ``batch`` (arrays or ShapeDtypeStructs)."""
        if self._fixed_plan is not None:
            self._fixed_plan.check_tree(params)
            return self._fixed_plan
        local = _local_batch_shape(batch, self.num_devices)
        if self.microbatches > 1:
            local = accum_lib.microbatch_shape(local, self.microbatches)
        weights = None
        if self.weighted:
            weights = jax.ShapeDtypeStruct((jax.tree.leaves(local)[0].shape[0],), jnp.float32)
        del mask  # only its shape matters, which the batch fixes
        obj = self._objective(model_state is not None)
        return buckets_lib.plan_buckets(
            obj.plan_fun,
            params,
            model_state,
            local,
            weights,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb,
            keep_unused=self.keep_unused,
        )

    def _objective(self, stateful: bool) -> Objective:
        return Objective(
            self.loss_fn, has_aux=self.has_aux, stateful=stateful,
            sync=self.model_state_sync, weighted=self.weighted,
        )

    def _plan_inside(
        self, params: Any, fun: Callable[..., Any], args: tuple
    ) -> buckets_lib.BucketPlan:
        """The plan for ``fun(params, *args)`` (the scalar that is differentiated), at trace time."""
        if self._fixed_plan is not None:
            self._fixed_plan.check_tree(params)
            plan = self._fixed_plan
        else:
            plan = buckets_lib.plan_buckets(
                fun,
                params,
                *args,
                bucket_cap_mb=self.bucket_cap_mb,
                first_bucket_mb=self.first_bucket_mb,
                keep_unused=self.keep_unused,
            )
        if plan.unused and not self._warned_unused:
            # Once per DataParallel (at trace time), instead of DDP's per-iteration graph search.
            self._warned_unused = True
            warnings.warn(
                unused_lib.unused_message([plan.paths[i] for i in plan.unused]), stacklevel=2
            )
        self._last_plan = plan
        return plan

    # ----------------------------------------------------------------------------------- step

    def _check_inputs(self, state: Any, batch: Any, mask: Any) -> Any:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"step expects the TrainState returned by init (or a previous step), got "
                f"{type(state).__name__}."
            )
        reduce_lib._check_float_params(state.params)
        size = mesh_lib.check_batch(batch, self.num_devices)
        if not self.weighted:
            if mask is not None:
                raise ValueError(
                    "step got a mask, but this DataParallel averages per-shard mean losses. "
                    "Construct it with weighted=True and make loss_fn return per-example losses."
                )
            return None
        if mask is None:
            return jnp.ones((size,), jnp.float32)
        return uneven_lib.check_mask(mask, size)

    def _step(
        self,
        state: TrainState,
        batch: Any,
        mask: Any = None,
        sync: bool | None = None,
        phase: Any = None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        mask = self._check_inputs(state, batch, mask)
        accum_lib.check_call(
            state, batch, sync, accumulate_steps=self.accumulate_steps,
            microbatches=self.microbatches, num_devices=self.num_devices,
        )
        specs = _state_specs(state, self.axis_name, self._per_device_ms)
        if self._accumulating:
            accumulating = jax.shard_map(
                functools.partial(
                    accum_lib.local_step, self, self._objective(state.model_state is not None),
                    sync=sync, phase=phase,
                ),
                mesh=self.mesh,
                in_specs=(specs, P(self.axis_name)),
                out_specs=(specs, P(), P(self.axis_name)),
                check_vma=True,
            )
            new_state, metrics, local_metrics = accumulating(state, batch)
            return new_state, {**metrics, **local_metrics}
        sharded = jax.shard_map(
            functools.partial(self._local_step, phase=phase),
            mesh=self.mesh,
            in_specs=(specs, P(self.axis_name), P(self.axis_name)),
            out_specs=(specs, P()),
            check_vma=True,
        )
        return sharded(state, batch, mask)

    def _local_step(self, state: TrainState, batch: Any, mask: Any, phase: Any = None):
        axis = self.axis_name
        n = self.num_devices
        stateful = state.model_state is not None
        per_device_ms = stateful and self._per_device_ms
        obj = self._objective(stateful)
        model_state = state.model_state
        if per_device_ms:
            model_state = jax.tree.map(lambda x: x[0], model_state)
        args = (model_state, batch, mask)
        plan = self._plan_inside(state.params, obj.plan_fun, args)
        hook_state = jax.tree.map(lambda x: x[0], state.hook_state)
        (loss, aux), grads, new_hook_state, extras = reduce_lib.bucketed_value_and_grad(
            obj.fun,
            state.params,
            args,
            axis_name=axis,
            plan=plan,
            hook=self.hook,
            hook_state=hook_state,
            step=state.step,
            has_aux=True,
            extras_fn=obj.extras_fn(axis, n),
            chain=self.chain,
            phase=phase,
        )
        local = mask.shape[0] if mask is not None else 0
        grads, metrics, new_model_state = obj.finish(grads, extras, aux, n, local)
        return self._apply(
            state, grads, metrics, plan=plan, hook_state=new_hook_state, model_state=new_model_state
        )

    def _apply(
        self,
        state: TrainState,
        grads: Any,
        metrics: dict[str, jax.Array],
        *,
        plan: buckets_lib.BucketPlan,
        hook_state: Any,
        model_state: Any,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """Applies reduced gradients: the one update path of every synchronising step.

        Used by the plain step and by the synchronising call of accumulation
        (:func:`jddp.accumulate.local_step`), so optimizer, model state, ``skip_nonfinite`` and
        ``comm_bytes`` behave identically in both.

        Args:
          state: the state the step started from (inside ``shard_map``: per-device leaves carry
            their local leading dimension of 1).
          grads: the reduced gradients (identical on every replica).
          metrics: the reduced metrics (from :meth:`jddp.objective.Objective.finish`).
          plan: the bucket plan the gradients were reduced with (for ``comm_bytes``).
          hook_state: the hook's new local state, without the device dimension.
          model_state: the synchronised new model state (local, without a device dimension), or
            ``None``.

        Returns:
          ``(new_state, metrics)``. ``state.accum`` is passed through unchanged: resetting it is
          the accumulation step's business, and a skipped window must reset it too.
        """
        metrics = dict(metrics)
        # Static accounting (no collective): bytes each device sends for this step's gradients.
        metrics["comm_bytes"] = hooks_lib.plan_bytes_sent(
            self.hook, plan, self.num_devices, state.step
        )
        if state.model_state is not None and self._per_device_ms:
            model_state = jax.tree.map(lambda x: x[None], model_state)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        new_state = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            model_state=model_state,
            hook_state=jax.tree.map(lambda x: x[None], hook_state),
        )
        if self.skip_nonfinite:
            # Reduced gradients are identical on every replica: so is this decision. The
            # accumulator is left out of the selection (selecting it would copy the donated sums).
            finite = nonfinite_lib.all_finite(grads)
            new_state = nonfinite_lib.select_tree(
                finite, new_state.replace(accum=None), state.replace(accum=None)
            ).replace(accum=state.accum)
            metrics["skipped"] = jnp.where(finite, 0.0, 1.0).astype(jnp.float32)
        return new_state, metrics

    def _loss_with_aux(self, params: Any, batch: Any):
        """``(loss, metrics)`` of a stateless ``loss_fn`` (used by ``jddp.calibrate``; the step
        itself goes through :class:`jddp.objective.Objective`)."""
        out = self.loss_fn(params, batch)
        if not self.has_aux:
            return out, {}
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                f"With has_aux=True, loss_fn must return (loss, metrics), got {type(out).__name__}."
            )
        return out

    def verify(self, state: TrainState, *, atol: float = 0.0) -> None:
        """Raises :class:`jddp.ReplicaDivergenceError` if replicas of ``state`` differ.

        Checks ``step``, ``params``, ``opt_state`` and (unless per-device) ``model_state``; the
        per-device hook and accumulator state are meant to differ.
        """
        tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
        if self.model_state_sync != "none":
            tree["model_state"] = state.model_state
        verify_lib.verify_replicas(tree, self.mesh, atol=atol)

    def lower(
        self,
        params_like: Any,
        batch_like: Any,
        model_state_like: Any = None,
        sync: bool | None = None,
        *,
        step: int | None = None,
    ):
        """Lowers the step that ``step`` runs, from abstract (or concrete) params and batch.

        Args:
          params_like: the params, or ``jax.ShapeDtypeStruct``s of them.
          batch_like: a global batch, or ``jax.ShapeDtypeStruct``s (placed on the data axis if
            they carry no sharding).
          model_state_like: the model state, or its shape structs, if the model has one.
          sync: the accumulation variant (see :mod:`jddp.accumulate`); ``None`` by default.
          step: the step whose program to lower, for hooks that change with it (PowerSGD's
            ``start_iter``; default: step 0).

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
        phase_fn = getattr(self.hook, "phase", None)
        phase = None if phase_fn is None else phase_fn(int(step or 0))
        return self._jit_step.lower(state, batch, sync=sync, phase=phase)


class _PhasedStep:
    """``ddp.step``: the jitted step, specialised on the hook's static phase (``hook.phase``).

    Hooks whose collectives change with the step (PowerSGD's ``start_iter``) get one compiled step
    per phase instead of a ``lax.cond`` around collectives. The phase needs the step on the host:
    it is remembered for states this object returned, so a training loop does not sync; any other
    state costs one device-to-host read. Hooks without ``phase`` skip all this.
    """

    def __init__(self, ddp: DataParallel) -> None:
        self._ddp = ddp
        self._known: tuple[Any, int] | None = None  # (weakref to a returned step array, its value)
        self._last_phase: Any = None

    def _host_step(self, state: Any) -> int:
        step = getattr(state, "step", None)
        if self._known is not None and self._known[0]() is step:
            return self._known[1]
        return int(jax.device_get(step))

    def _phase(self, state: Any, step: int | None = None) -> Any:
        phase_fn = getattr(self._ddp.hook, "phase", None)
        if phase_fn is None:
            return None
        if step is None:
            s = getattr(state, "step", None)
            step = 0 if isinstance(s, jax.ShapeDtypeStruct) else self._host_step(state)
        return phase_fn(int(step))

    def __call__(
        self, state: Any, batch: Any, mask: Any = None, sync: bool | None = None
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        phase_fn = getattr(self._ddp.hook, "phase", None)
        if phase_fn is None:
            return self._ddp._jit_step(state, batch, mask, sync=sync)
        step = self._host_step(state)
        phase = phase_fn(step)
        if phase != self._last_phase:
            # Switching executables: let the previous step finish first. With simulated CPU devices,
            # two executables with collectives in flight at once were seen to deadlock XLA:CPU.
            jax.block_until_ready(state)
            self._last_phase = phase
        new_state, metrics = self._ddp._jit_step(state, batch, mask, sync=sync, phase=phase)
        self._known = (weakref.ref(new_state.step), step + 1)
        return new_state, metrics

    def lower(
        self, state: Any, batch: Any, mask: Any = None, sync: bool | None = None, *,
        step: int | None = None,
    ) -> jax.stages.Lowered:
        return self._ddp._jit_step.lower(
            state, batch, mask, sync=sync, phase=self._phase(state, step)
        )


def _local_batch_shape(batch: Any, n: int) -> Any:
    def local(x):
        shape = jnp.shape(x)
        return jax.ShapeDtypeStruct((shape[0] // n, *shape[1:]), jnp.result_type(x))

    mesh_lib.check_batch(batch, n)
    return jax.tree.map(local, batch)
