"""``DataParallel``: builds the step's configuration and hands out the step; owns no step logic."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import optax
from jax.sharding import Mesh

from jddp._src.api import deprecated as deprecated_lib
from jddp._src.api import options
from jddp._src.api import policies as pol
from jddp._src.core import precision as precision_lib
from jddp._src.place import offload
from jddp._src.plan import autocap, modelcap
from jddp._src.plan import report as report_lib
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.hooks.mean import allreduce_mean
from jddp._src.reduce.reducers import BaseReducer, Bucketed
from jddp._src.runtime import mesh as mesh_lib
from jddp._src.runtime import verify as verify_lib
from jddp._src.runtime import watchdog
from jddp._src.step import checks, compat, skeleton
from jddp._src.step.config import Reducer, StepConfig
from jddp._src.step.state import TrainState
from jddp._src.step.step import PlanLog, Step
from jddp._src.sync import model_state as ms_lib
from jddp._src.sync.local_sgd import LocalSGD

Chooser = autocap.AutoCap | modelcap.ModelCap


def _candidates(config: StepConfig,
                make_step: Callable[[StepConfig, skeleton.PlanObserver], Step]
                ) -> autocap.Candidates:
    """What ``Buckets(cap_mb="auto"/"model")``'s choosing step needs of ``config``."""
    buckets = config.reduce
    assert isinstance(buckets, Bucketed)  # a chooser is a jddp.Buckets request

    def build(cap: int, first: int, observer: skeleton.PlanObserver) -> Step:
        reduce = dataclasses.replace(buckets, cap_bytes=cap, first_bytes=first)
        return make_step(dataclasses.replace(config, reduce=reduce), observer)

    def plan(state: Any, batch: Any, mask: Any = None, rng: Any = None) -> BucketPlan:
        return skeleton.plan(config, state, batch, mask, rng)

    return autocap.Candidates(buckets.cap_bytes, buckets.first_bytes, build, plan,
                              config.accumulate.reducing, config.mesh.devices.flat[0].platform,
                              config.topology.num_devices)


def _verify_every(verify_every: Any) -> int:
    """``verify_every`` checked: a positive int, or 0 for None (never verify)."""
    if verify_every is not None and (isinstance(verify_every, bool) or not isinstance(
            verify_every, int) or verify_every < 1):
        raise ValueError(f"verify_every must be a positive int K (check the replicas every K "
                         f"steps) or None, got {verify_every!r}.")
    return verify_every or 0


def _reducer(p: pol.Policies, precision: Any) -> Reducer:
    """The step's reducer: a reducer policy itself (any ``BaseReducer``, as
    ``jddp.Deterministic``), or the bucketed reducer of ``jddp.Buckets`` (the hook the precision
    implies, the caps in bytes, and with nothing pinned the default plan's chooser where it was
    measured)."""
    reduce = p.reduce
    if isinstance(reduce, BaseReducer):
        # BaseReducer holds the defaults; the subclass implements the rest of the protocol.
        return cast(Reducer, reduce)
    hook = precision_lib.resolve_hook(precision, reduce.hook)
    hook = allreduce_mean() if hook is None else hook
    cap, first = reduce.caps()
    chooser = None if reduce.pinned else modelcap.default_plan(hook, p.place.sharded,
                                                                p.sync.islands)
    return Bucketed(hook=hook, chain=reduce.chain, cap_bytes=cap, first_bytes=first,
                    fixed_plan=reduce.plan, default_plan=chooser, keep_unused=reduce.keep_unused)


def step_config(loss_fn: Callable[..., Any], optimizer: Any, mesh: Mesh, p: pol.Policies,
                precision: Any) -> StepConfig:
    """The step's configuration from its policies, after the compatibility table
    (:mod:`jddp._src.step.compat`)."""
    c = compat.Combination(policies=p, precision=precision_lib.check_policy(precision),
                           devices=int(mesh.size), two_level=mesh_lib.data_axes(mesh).two_level)
    compat.check(c)
    acc = p.accumulate
    return StepConfig(
        loss_fn=loss_fn, optimizer=check_optimizer(optimizer), mesh=mesh,
        reduce=_reducer(p, c.precision), loss=p.loss,
        accumulate=dataclasses.replace(acc, shard=compat.resolve_shard(acc, c)),
        guard=p.loss_scale, sync=p.sync, precision=c.precision, place=p.place)


def check_optimizer(optimizer: Any) -> optax.GradientTransformation:
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        hint = " (call the factory, e.g. optax.adam(1e-3))" if callable(optimizer) else ""
        raise TypeError(
            "optimizer must be an optax GradientTransformation (with init and update), got "
            f"{type(optimizer).__name__}{hint}."
        )
    return optimizer


class DataParallel:
    """Data-parallel training of ``loss_fn`` with ``optimizer`` over a data mesh.

    Parameters are replicated on every device, the global batch is split on its leading
    dimension, and gradients are averaged across devices in size-capped buckets reduced from
    inside the backward pass (like PyTorch DDP): a step on N devices equals a single-device step
    of ``loss_fn`` on the whole batch. ``step`` consumes (donates) its input state: keep using the
    state it returns. Guide: [Getting started](../getting-started.md); how a step runs:
    [Concepts](../concepts.md).

    Example::

        ddp = jddp.DataParallel(loss_fn, optax.adam(1e-3), mesh=jddp.data_mesh(),
                                loss=jddp.Loss(has_aux=True),
                                place=jddp.ZeRO(stage=2),
                                accumulate=jddp.Accumulate(steps=4))
        state = ddp.init(params)
        state, metrics = ddp.step(state, batch)   # batch: leading dim = global batch

    Each feature is one policy, a frozen value that checks its own fields
    (`jddp.Loss`, `jddp.Buckets`, `jddp.ZeRO`, ...); combinations that do not work together are
    refused by one table, each with its reason. The keywords of jddp 0.1.0 still work for one
    release, each with a ``DeprecationWarning`` naming its policy ([Migrating](../migration.md)
    lists them).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss``, the mean loss over its shard of the batch; with
        ``Loss(has_aux=True)``, ``(loss, metrics)`` where ``metrics`` is a dict of float scalars.
        When ``init`` is given ``model_state``: ``loss_fn(params, model_state, batch) -> (loss,
        new_model_state)``, or with ``has_aux`` ``(loss, (new_model_state, metrics))``. With
        ``Loss(weighted=True)``, ``loss`` is the unreduced losses of the shard. See
        [Model state](../model_state.md).
      optimizer: an optax ``GradientTransformation``; it sees the averaged gradients, so
        transforms such as ``clip_by_global_norm`` act on the global gradient.
      mesh: the data mesh (default: ``jddp.data_mesh()``, every device).
      loss: :class:`jddp.Loss`: what ``loss_fn`` returns (``has_aux``, ``weighted``, ``rng``,
        ``sum_metrics``) and how the new model state is made consistent
        (``model_state_sync``). Default ``jddp.Loss()``.
      reduce: the gradient reduction: :class:`jddp.Buckets` (``cap_mb``, ``first_mb``,
        ``hook``, ``plan``, ``chain``, ``keep_unused``; DDP's buckets, the default) or
        :class:`jddp.Deterministic` (``group_size``: the same bits on any layout,
        [Determinism](../deterministic.md)).
      place: where the training state lives: :class:`jddp.Replicate` (the default, DDP) or
        :class:`jddp.ZeRO` (``stage``, ``reshard_after_forward``, ``hybrid``, ``offload``;
        [ZeRO](../sharded.md)).
      accumulate: :class:`jddp.Accumulate` (``steps``, ``microbatches``, ``dtype``,
        ``shard``; [Gradient accumulation](../accumulate.md)). Default: no accumulation.
      sync: how replicas stay in step: :class:`jddp.EveryStep` (the default), or
        ``jddp.local_sgd.post_local_sgd(...)`` / ``jddp.local_sgd.diloco(...)`` (replicas
        train apart and average every ``period`` steps; read :meth:`global_params` to
        evaluate; [Slow links](../scaling.md)).
      precision: ``jddp.precision.MixedPrecision(param_dtype=..., reduce_dtype=...)``: float32
        master parameters, compute in ``param_dtype``, gradients reduced in ``reduce_dtype``
        ([Mixed precision](../precision.md)). ``None``: off.
      loss_scale: the update guard: ``jddp.precision.DynamicScale()`` (dynamic loss scaling for
        float16: non-finite steps are skipped and the scale adapts; ``state.loss_scale``,
        ``metrics["loss_scale"]``), :class:`jddp.SkipNotFinite` (skip steps whose reduced
        gradient has a NaN or Inf, ``metrics["skipped"]``), or ``None``.
      donate: donate the old state's buffers to the new one (default True).
      compiler_options: XLA options for compiling the step (``jax.jit(compiler_options=...)``),
        e.g. ``jddp.perf.xla_flags.recommended("gpu", cap).compiler_options``.
      verify_every: every ``K`` calls of ``step``, a cheap check that the replicas' parameters
        are still equal (one uint32 hash per parameter and device, one small all-gather; it
        waits for that step): ``jddp.ReplicaDivergenceError`` names the leaf and the replicas
        whose copy differs. See [Reports](../report.md).
      **renamed: the deprecated 0.1.0 keywords, each mapped onto the field of its policy.

    The metrics of a step are listed under :attr:`step`; the names the step writes itself
    (``"loss"``, ``"comm_bytes"``, ``"skipped"``, ...) are reserved for it.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        mesh: Mesh | None = None,
        loss: pol.Loss | None = None,
        reduce: pol.Buckets | pol.Deterministic | None = None,
        place: pol.Replicate | pol.ZeRO | None = None,
        accumulate: pol.Accumulate | None = None,
        sync: pol.EveryStep | LocalSGD | None = None,
        precision: precision_lib.MixedPrecision | None = None,
        loss_scale: pol.Guard | None = None,
        donate: bool = True,
        compiler_options: dict[str, Any] | None = None,
        verify_every: int | None = None,
        **renamed: Any,
    ) -> None:
        given = dict(loss=loss, reduce=reduce, place=place, accumulate=accumulate, sync=sync,
                     precision=precision, loss_scale=loss_scale)
        new = deprecated_lib.policies_from_keywords(renamed, given)
        donate = options.flag(donate, "donate")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        precision = new.pop("precision")
        policies = pol.Policies(**{k: v for k, v in new.items() if v is not None or
                                   k == "loss_scale"})
        mesh = mesh_lib.check_mesh(mesh_lib.data_mesh() if mesh is None else mesh)
        config = step_config(loss_fn, optimizer, mesh, policies, precision)
        config.reduce.check(skeleton.reduce_context(config))
        object.__setattr__(self, "policies", policies)
        auto = policies.reduce.chooser() if isinstance(policies.reduce, pol.Buckets) else None
        self._install_step(config, auto, donate, compiler_options, _verify_every(verify_every))

    def _install_step(self, config: StepConfig, auto: Chooser | None, donate: bool,
                      compiler_options: dict[str, Any] | None, every: int) -> None:
        """Sets ``config``, ``_plans``, ``step`` and ``_auto``: the compiled step of ``config``,
        or with ``Buckets(cap_mb="auto")``/``"model"`` the step that chooses its plan first."""
        plans = PlanLog()
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "_plans", plans)

        def make_step(cfg: StepConfig, observer: skeleton.PlanObserver) -> Step:
            return Step(cfg, donate=donate, compiler_options=compiler_options, observer=observer,
                        verify_every=every)

        def chosen(step: Step, _: autocap.CapChoice) -> None:
            object.__setattr__(self, "config", step.config)

        # Buckets(cap_mb="auto" / "model"): the plan is chosen on the first step (timed, see
        # _src/plan/autocap.py; predicted, see _src/plan/modelcap.py), then fixed; the configuration takes
        # the chosen caps.
        step: Step | autocap.AutoStep | modelcap.ModelStep
        if isinstance(auto, modelcap.ModelCap):
            step = modelcap.ModelStep(_candidates(config, make_step), auto, plans, chosen)
        elif auto is not None:
            step = autocap.AutoStep(_candidates(config, make_step), auto, plans, chosen)
        else:
            step = make_step(config, plans)
        object.__setattr__(self, "_auto", step if auto is not None else None)
        # Under jddp-run, each call reports its completed step to the launcher's watchdog (a
        # queue append, about 0.6 us); elsewhere this is the step itself.
        object.__setattr__(self, "step", watchdog.reporting(step))

    config: StepConfig
    policies: pol.Policies
    """The step's policies (the defaults filled in; deprecated keywords mapped onto them)."""
    _plans: PlanLog
    _auto: autocap.AutoStep | modelcap.ModelStep | None
    step: Step | autocap.AutoStep | modelcap.ModelStep
    """step(state: TrainState, batch: Any, mask: Any = None, *, sync: bool | None = None,
    rng: Array | None = None) -> tuple[TrainState, dict[str, Array]]

    One training step, compiled on the first call: forward and backward on each device's shard
    of ``batch``, the gradients averaged across devices (in buckets, inside the backward pass),
    and the optimizer's update. Consumes ``state`` (its buffers become the new state's): always
    rebind, ``state, metrics = ddp.step(state, batch)``. ``ddp.step.lower(state, batch)`` gives
    the program a call would run.

    Args:
      state: the `jddp.TrainState` from :meth:`init`, a restore, or the previous step.
      batch: a pytree of arrays whose leading dimension is the global batch, a multiple of the
        device count: NumPy or host arrays (each process passes the same global batch, or a
        ``jddp.data.Loader``'s), or arrays already sharded with ``jddp.shard_batch``.
      mask: with ``Loss(weighted=True)``, the weights of the losses ``loss_fn`` returns:
        ``jddp.data.pad_batch``'s boolean mask of the real examples, or weights shaped like the
        per-example (or per-token) losses.
      sync: with ``Accumulate(steps=k)``, whether this call ends the accumulation window
        (reduces and updates); ``None``: every ``k``-th call does.
      rng: with ``Loss(rng=True)``, the step's PRNG key; ``loss_fn`` receives one key per
        example (`jddp.random.example_keys`).

    Returns:
      ``(state, metrics)``: the new `jddp.TrainState` and a dict of scalars (per device where
        marked): ``"loss"`` (the mean loss of this call's examples, as every aux metric;
        with ``Accumulate``, ``"window_loss"`` is the window's),
        ``"comm_bytes"`` (bytes this device sent in the step's collectives) and
        ``"comm_bytes_hosts"`` (of those, across hosts on a two-level mesh), ``"skipped"`` (1.0
        when the update was skipped: a non-finite gradient under ``loss_scale``, or no real
        example under ``Loss(weighted=True)``), ``"synced"`` (whether the call reduced, with
        accumulation), ``"loss_scale"`` (with a loss scale), ``"averaged"`` and
        ``"replica_loss"`` (local SGD), ``"local_loss"`` (per device, with accumulation), the
        loss's aux metrics (``Loss(has_aux=True)``), and each scalar hyperparameter of an
        ``optax.inject_hyperparams`` optimizer under its name (``"learning_rate"``).

    Raises:
      ValueError: ``state`` was consumed by an earlier step (rebind the returned one, or
        ``DataParallel(donate=False)``); a batch whose size is not a multiple of the device
        count, or whose shapes differ between processes; a ``loss_fn`` whose output does not
        match the `jddp.Loss` policy (each message names the fix).
      TypeError: ``state`` is not this trainer's `jddp.TrainState`.
      jddp.ProgramMismatchError: processes compiled different step programs (before any of
        its collectives runs).
      jddp.ReplicaDivergenceError: with ``verify_every``, replicas whose parameters differ.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"DataParallel options are fixed at construction (the step is compiled from them): "
            f"cannot set {name!r}. Build a new jddp.DataParallel(...) with the option you want."
        )

    # Read-only views of the configuration.
    loss_fn = property(lambda self: self.config.loss_fn)
    optimizer = property(lambda self: self.config.optimizer)
    mesh = property(lambda self: self.config.mesh)
    axis_name = property(lambda self: self.config.topology.data)
    # The buckets' communication hook (None for a reduction without buckets).
    hook = property(lambda self: getattr(self.config.reduce, "hook", None))
    model_state_sync = property(lambda self: self.config.loss.model_state_sync)

    @property
    def num_devices(self) -> int:
        """The number of devices of the data mesh (replicas)."""
        return self.config.topology.num_devices

    @property
    def bucket_plan(self) -> BucketPlan | None:
        """The bucket plan of the most recently traced step (``None`` before the first step)."""
        plan, choice = self._plans.latest, self.cap_choice
        if self._auto is None:  # a fixed cap, or the default plan (its note is its own)
            return plan
        if plan is not None and choice is not None and choice.method == "model":
            plan = plan._replace(note=f"chosen by Buckets(cap_mb='model') (cost model, nothing "
                                      f"timed): {choice.note}; pin it with {choice.pin}")
        elif plan is not None and choice is not None:
            n = len(choice.candidates_mb)
            how = (f"from {n} timed caps" if n > 1 else
                   "without timing: every candidate cap gives this one plan")
            plan = plan._replace(note=f"chosen by Buckets(cap_mb='auto') {how}; pin it with "
                                      f"{choice.pin}")
        return plan

    @property
    def cap_choice(self) -> autocap.CapChoice | None:
        """What ``Buckets(cap_mb="auto")`` or ``"model"`` chose (``None`` before the choice, or
        for a fixed cap); ``print`` it for the timings or predictions, the reason and the
        arguments that pin the choice (``cap_choice.pin``). With no cap given, the default
        plan's choice (``method="default"``), made when the step (or ``plan``) is traced."""
        if self._auto is not None:
            return self._auto.choice
        plan = self._plans.latest or self._plans.planned
        if plan is None:
            return None
        return self.config.reduce.choice(plan, self.config.mesh.devices.flat[0].platform,
                                         self.config.topology.num_devices)

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """Builds the replicated initial state: params, optimizer state, hook state, step 0.

        In a multi-process job every process must pass a tree of the same structure, shapes and
        dtypes (checked), and all start from process 0's values (DDP's initial broadcast).

        Args:
          params: the initial parameters (floating-point leaves).
          model_state: optional non-differentiated model state (e.g. Flax ``batch_stats``).
        """
        checks.check_float_params(params)
        precision_lib.check_master(self.config.precision, params)
        self._plans.expect(params)
        self.config.reduce.check_params(params)
        ms_lib.check_model_state(model_state, self.config.loss.model_state_sync)
        params, model_state = verify_lib.sync_from_process0((params, model_state), "params")
        shardings = skeleton.state_shardings(
            self.config, jax.eval_shape(self._build, params, model_state)
        )
        return jax.jit(self._build, out_shardings=shardings)(params, model_state)

    def _build(self, params: Any, model_state: Any) -> TrainState:
        return skeleton.build_state(self.config, params, model_state)

    def abstract_state(self, params: Any = None, model_state: Any = None,
                       **renamed: Any) -> TrainState:
        """The TrainState ``init`` would build, as ``jax.ShapeDtypeStruct``s with shardings.

        Nothing is allocated or computed, so this works on meshes of compile-only devices.

        Args:
          params: the parameters, as arrays or ``jax.ShapeDtypeStruct``s (as ``init`` takes).
          model_state: the model state, likewise (``init``'s keyword).
          **renamed: ``params_like``/``model_state_like``, the old names (deprecated).
        """
        params, model_state = options.renamed_args(
            "abstract_state", {"params": params, "model_state": model_state}, renamed,
            {"params_like": "params", "model_state_like": "model_state"}).values()
        if params is None:
            raise TypeError("abstract_state() missing the parameters: abstract_state(params, "
                            "model_state=None), as init takes them.")
        return skeleton.abstract_state(self.config, params, model_state)

    def plan(self, params: Any, batch: Any, model_state: Any = None, mask: Any = None) -> BucketPlan:
        """The bucket plan the step uses for ``params`` and a global ``batch``, before any step.

        The same planning code as the step's (it traces the step, without compiling it), so it
        works for models that communicate in their forward pass too (cross-replica BatchNorm).
        ``params``, ``batch`` and ``mask`` may be arrays or ``jax.ShapeDtypeStruct``s. With
        ``Buckets(cap_mb="auto")``, only once the cap is chosen; with ``"model"``, the cost model
        chooses here if no step has (``cap_choice`` says why).
        """
        if isinstance(self._auto, modelcap.ModelStep):
            self._auto.choose(self.abstract_state(params, model_state), batch, mask)
        elif self._auto is not None:
            self._auto.chosen_step("plan")
        plan = skeleton.plan(self.config, self.abstract_state(params, model_state), batch, mask)
        self._plans.record(plan)  # cap_choice asks the default plan about it before a step
        return plan

    def lower(
        self,
        params: Any = None,
        batch: Any = None,
        model_state: Any = None,
        *,
        sync: bool | None = None,
        step: int | None = None,
        **renamed: Any,
    ) -> jax.stages.Lowered:
        """Lowers the step from abstract (or concrete) params and batch: ``step.lower`` on
        :meth:`abstract_state`. ``.compile().as_text()`` is the compiled HLO; with a mesh of
        compile-only devices (``jddp.perf``) it is the program a GPU or TPU cluster would run.

        Args:
          params: the parameters, as arrays or ``jax.ShapeDtypeStruct``s (as ``init`` takes).
          batch: a global batch, likewise.
          model_state: the model state, likewise (``init``'s keyword).
          sync: the accumulation variant (see docs/accumulate.md).
          step: the step whose program to lower, for hooks that change with it (PowerSGD's
            ``start_iter``; default: step 0).
          **renamed: ``params_like``/``batch_like``/``model_state_like``, the old names
            (deprecated).
        """
        params, batch, model_state = options.renamed_args(
            "lower", {"params": params, "batch": batch, "model_state": model_state}, renamed,
            {"params_like": "params", "batch_like": "batch",
             "model_state_like": "model_state"}).values()
        if params is None or batch is None:
            raise TypeError("lower() takes the parameters and a global batch: lower(params, "
                            "batch, model_state=None), as init and step take them.")
        state = self.abstract_state(params, model_state)
        return self.step.lower(state, batch, sync=sync, step=step)

    def report(
        self, state: Any, batch: Any, mask: Any = None, *, sync: bool | None = None,
        rng: Any = None,
    ) -> report_lib.Report:
        """The compiled step's communication contract and memory, read from its program.

        ``rep.collectives``: each collective (kind, bytes, dtype, group size, level, the bucket
        it serves, in a loop or not, bytes sent per device, overlapped compute on GPU);
        totals per step and per window (``accumulate_steps``), bytes across hosts;
        ``rep.memory``: per-device sizes (at rest, arguments, temporaries, peak). ``print(rep)``
        is a table, ``rep.to_dict()`` JSON. See docs/report.md.

        Compiles the program ``ddp.step(state, batch, mask, sync=sync)`` runs (the step reuses
        that compile); nothing runs. ``state`` may be abstract (``ddp.abstract_state``), on a
        mesh of compile-only devices (``jddp.perf.topologies``).
        """
        compiled = self.step.lower(state, batch, mask, sync=sync, rng=rng).compile()
        window = self.config.accumulate.calls(sync)
        owners = self.config.place.owners(self.config.topology, state.params,
                                          self._plans.latest)
        return report_lib.build(compiled, state, mesh_lib.host_of_device(self.config.mesh),
                                window, self._plans.latest, owners)

    def verify(self, state: TrainState, *, atol: float = 0.0) -> None:
        """Raises :class:`jddp.ReplicaDivergenceError` if replicas of ``state`` differ.

        Checks ``step``, ``params``, ``opt_state`` and (unless per-device) ``model_state``; the
        per-device hook and accumulator state are meant to differ, and the leaves a sharded
        stage splits have no replicas to compare. With local SGD, the copies of each replica
        (the devices of a host) and DiLoCo's outer state.
        """
        tree = {"step": state.step, "params": state.params,
                "opt_state": offload.device_copy(state.opt_state),
                "loss_scale": self.config.update.guard_state(state.update_state)}
        if self.config.loss.model_state_sync != "none":
            tree["model_state"] = state.model_state
        if self.config.topology.islands and not self.config.topology.two_level:
            # One replica per device: no two devices hold copies of a replica's leaves.
            tree = {"step": state.step}
        if state.sync_state is not None:
            tree["sync_state"] = state.sync_state
        # With local SGD the per-replica leaves are compared inside each replica (the devices of
        # a host), replicated ones everywhere. At the sharded stages a split leaf has one copy of
        # each piece: nothing to compare.
        mesh_axes = set(self.config.mesh.axis_names)

        def copies(x: Any) -> Any:
            if x.sharding.is_fully_replicated:
                return x
            if not self.config.topology.islands:
                return None
            # A replica's leaf split over the devices of its island has no copies either.
            spec = getattr(x.sharding, "spec", ())
            used = {a for s in spec if s is not None
                    for a in (s if isinstance(s, tuple) else (s,))}
            return None if mesh_axes <= used else x

        replicated = jax.tree.map(copies, tree)
        verify_lib.verify_replicas(replicated, self.config.mesh, atol=atol)

    def global_params(self, state: TrainState) -> Any:
        """The parameters to evaluate or export: ``state.params``; with local SGD the mean of the
        replicas' parameters (each replica's own right after an averaging step), with DiLoCo the
        outer (global) parameters. Replicated on the mesh."""
        return skeleton.global_params(self.config, state)
