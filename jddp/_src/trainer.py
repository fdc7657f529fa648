"""``DataParallel``: builds the step's configuration and hands out the step; owns no step logic."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jddp._src import autocap, checks, local_sgd_options, modelcap, options, pipeline, watchdog
from jddp._src import deterministic as det_lib
from jddp._src import local_sgd as local_sgd_lib
from jddp._src import loss_scale as ls_lib
from jddp._src import mesh as mesh_lib
from jddp._src import model_state as ms_lib
from jddp._src import precision as precision_lib
from jddp._src import report as report_lib
from jddp._src import verify as verify_lib
from jddp._src.config import StepConfig
from jddp._src.hooks import CommHook, allreduce_mean, check_hook
from jddp._src.objective import check_metric_names
from jddp._src.planner import BucketPlan
from jddp._src.state import TrainState
from jddp._src.step import PlanLog, Step

_RENAMED = {"skip_nonfinite": "skip_not_finite", "accum_dtype": "accumulator_dtype"}


def _renamed_arguments(renamed: dict[str, Any], skip_not_finite: Any,
                       accumulator_dtype: Any) -> tuple[Any, Any]:
    """``(skip_not_finite, accumulator_dtype)`` after the deprecated names in ``renamed`` (each
    warns); any other name in ``renamed`` is a ``TypeError``."""
    for old, value in renamed.items():
        if old not in _RENAMED:
            raise TypeError(f"DataParallel() got an unexpected keyword argument {old!r}.")
        new = _RENAMED[old]
        # stacklevel 3: the warning points at the user's DataParallel(...) call.
        warnings.warn(f"DataParallel({old}=...) is now {new}= (optax's name).",
                      DeprecationWarning, stacklevel=3)
        if new == "skip_not_finite":
            skip_not_finite = value
        else:
            accumulator_dtype = value
    return skip_not_finite, accumulator_dtype


Chooser = autocap.AutoCap | modelcap.ModelCap


def _bucket_caps(bucket_cap_mb: Any, first_bucket_mb: Any,
                 bucket_plan: BucketPlan | None) -> tuple[Chooser | None, Any, Any]:
    """``(chooser, cap_bytes, first_bytes)``: the ``"auto"`` or ``"model"`` request (or None)
    and the checked caps in bytes (DDP's defaults for a chooser: the plan to beat)."""
    auto: Chooser | None = modelcap.resolve(bucket_cap_mb) or autocap.resolve(bucket_cap_mb)
    name = "'model'" if isinstance(auto, modelcap.ModelCap) else "'auto'"
    if auto is not None and bucket_plan is not None:
        raise ValueError(f"bucket_cap_mb={name} chooses the bucket plan, and bucket_plan fixes "
                         "one: pass only one of them.")
    if isinstance(auto, modelcap.ModelCap) and first_bucket_mb is not None:
        raise ValueError("bucket_cap_mb='model' chooses the first bucket too: drop "
                         "first_bucket_mb, or pin a plan with numbers (bucket_cap_mb=8.0, "
                         "first_bucket_mb=1.0).")
    # "auto" picks the cap; the first bucket is then DDP's default 1 MiB unless given.
    cap, first = options.bucket_caps(None if auto is not None else bucket_cap_mb,
                                     first_bucket_mb)
    return auto, cap, first


def _policy_and_hook(mixed_precision: Any, hook: Any, loss_scale: Any,
                     deterministic: bool) -> tuple[precision_lib.MixedPrecision | None, CommHook]:
    """The mixed-precision policy, checked, and the hook it implies (the user's, a compression
    hook for a narrow ``reduce_dtype``, or the default all-reduce)."""
    policy = precision_lib.check_policy(mixed_precision)
    hook = precision_lib.resolve_hook(policy, None if hook is None else check_hook(hook),
                                      loss_scale=loss_scale, deterministic=deterministic)
    return policy, allreduce_mean() if hook is None else hook


def _deterministic(deterministic: Any, group_size: Any,
                   auto: Chooser | None) -> tuple[bool, int]:
    """``options.deterministic``'s ``(deterministic, group_size)``, refusing ``"auto"`` and
    ``"model"`` caps with the bucket-free deterministic reduction."""
    det, groups = options.deterministic(deterministic, group_size)
    if det and auto is not None:
        name = "'model'" if isinstance(auto, modelcap.ModelCap) else "'auto'"
        raise ValueError(f"deterministic=True reduces without buckets, so bucket_cap_mb={name} "
                         "has nothing to choose (nothing to tune): drop it.")
    return det, groups


def _sum_metrics(sum_metrics: Any, has_aux: Any) -> tuple[str, ...]:
    """The checked ``sum_metrics`` names (aux metrics, so ``has_aux`` must be set)."""
    summed = options.metric_names(sum_metrics, "sum_metrics")
    check_metric_names(summed, "sum_metrics")
    if summed and not has_aux:
        raise ValueError(
            f"sum_metrics={summed} names aux metrics, but has_aux=False: return (loss, "
            "metrics) from loss_fn and pass has_aux=True."
        )
    return summed


def _scatters_without_state(hook: CommHook) -> bool:
    """Whether the sharded stages reduce-scatter through ``hook.scatter`` (a stateless hook
    with a scatter)."""
    return hook.scatter is not None and not jax.tree.leaves(
        hook.init(jax.ShapeDtypeStruct((8,), jnp.float32)))


def _verify_every(verify_every: Any) -> int:
    """``verify_every`` checked: a positive int, or 0 for None (never verify)."""
    if verify_every is not None and (isinstance(verify_every, bool) or not isinstance(
            verify_every, int) or verify_every < 1):
        raise ValueError(f"verify_every must be a positive int K (check the replicas every K "
                         f"steps) or None, got {verify_every!r}.")
    return verify_every or 0


def _checked(config: StepConfig, plan_given: bool) -> StepConfig:
    """``config`` after the checks across options, with the default plan's policy
    (:func:`jddp._src.modelcap.default_plan`) unless a cap, first bucket or plan was given."""
    local_sgd_lib.check_config(config)
    det_lib.check_config(config)
    if plan_given:
        return config
    return dataclasses.replace(config, default_plan=modelcap.default_plan(config))


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

    Parameters are replicated on every device, the global batch is split on its leading dimension,
    each device computes gradients of its shard, and the gradients are averaged across devices in
    size-capped buckets reduced from inside the backward pass (like PyTorch DDP). A step on N
    devices equals a single-device step of ``loss_fn`` on the whole batch.

    Example::

        ddp = jddp.DataParallel(loss_fn, optax.adam(1e-3), mesh=jddp.data_mesh())
        state = ddp.init(params)
        state, metrics = ddp.step(state, batch)   # batch: leading dim = global batch

    ``step`` consumes (donates) its input state: keep using the state it returns.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss``, the mean loss over its shard of the batch; with
        ``has_aux``, ``(loss, metrics)`` where ``metrics`` is a dict of float scalars (averaged over
        devices and returned with the loss). When ``init`` is given ``model_state``:
        ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``, or with ``has_aux``
        ``(loss, (new_model_state, metrics))``. With ``weighted``, ``loss`` is the unreduced
        losses of the shard (per example, or per token). See docs/model_state.md.
      optimizer: an optax ``GradientTransformation``; it sees the averaged gradients, so
        transforms such as ``clip_by_global_norm`` act on the global gradient.
      mesh: the data mesh (default: ``jddp.data_mesh()``, every device).
      bucket_cap_mb: bucket cap in MiB, packed by DDP's rule (``jddp.buckets.assign_buckets``),
        or ``"auto"`` or ``"model"`` (below). Not given (nor ``first_bucket_mb``, nor
        ``bucket_plan``): the plan ``"model"`` would pick among those with at least DDP's
        number of buckets, chosen inside the step's own trace
        (no timing, no extra trace; ``cap_choice`` says why and how to pin it), for stage 0
        with the default all-reduce hook, not ``deterministic``, no ``local_sgd``, on XLA:CPU
        (its built-in table); elsewhere, and on GPU/TPU, DDP's default: 25 MiB buckets after
        a 1 MiB first one. ``"auto"``: the first call of
        ``step`` times the step at the caps that give different bucket plans for this model
        (on copies of the state; one compile each), each round against 25 MiB, and keeps a cap
        only when it beats 25 MiB by more than 3% and by more than the spread of its own rounds
        (else 25 MiB), within ``max_tune_s`` (120 s); ``cap_choice`` reports the ratios, the
        spreads and the number that pins the choice. A ``jddp.buckets.AutoCap(...)`` changes
        the candidates, rounds, margin and time bound. Or ``"model"``: the cost model picks
        the plan (cap and first bucket) from the traced gradient sizes, with no timing, on the
        first call of ``step``, ``lower`` or ``plan``; on XLA:CPU from a built-in table, on
        GPU/TPU DDP's plan unless a ``jddp.buckets.ModelCap(cluster=..., backward_s=...)``
        describes the machine. Deterministic: every process picks the same plan. See
        docs/performance.md.
      first_bucket_mb: cap of the first bucket in MiB. By default PyTorch DDP's rule: 1 MiB
        when ``bucket_cap_mb`` is not given (or is ``"auto"``), none (the first bucket is capped
        like the others) when it is given; pass ``first_bucket_mb=1.0`` to keep a small one.
      has_aux: ``loss_fn`` also returns a dict of metrics.
      hook: communication hook for each bucket (default: mean all-reduce), e.g.
        ``jddp.fp16_compress()`` or ``jddp.powersgd(rank=1)``.
      bucket_plan: a fixed plan to use instead of planning from the traced use order.
      chain: how buckets are kept apart in the compiled step: ``"auto"`` (``"barrier"`` on GPU,
        ``"add"`` on CPU and TPU), ``"add"``, ``"barrier"``, or ``"none"`` to let XLA's combiner
        merge all-reduces as it likes.
      donate: donate the old state's buffers to the new one (default True).
      model_state_sync: how new model state is made consistent across replicas: ``"broadcast"``
        (replica 0's, bit-exact; DDP's ``broadcast_buffers``), ``"mean"`` (averaged; integer leaves
        broadcast) or ``"none"`` (one state per replica). No extra collective: it rides on the last
        bucket's all-reduce.
      weighted: ``loss_fn`` returns unreduced losses and ``step`` takes an optional ``mask`` (or
        weights) of their shape; the step averages over real entries only, across devices and
        accumulated micro-batches (uneven final batches, padding tokens; see ``jddp.pad_batch``).
        A step whose mask has no real entry is skipped (``metrics["skipped"]``).
      keep_unused: keep parameters without a gradient path to the loss in the buckets (by
        default they are left out, with a one-time warning naming them, and get zero gradients).
      skip_not_finite: skip the update (params, optimizer, model and hook state, ``state.step``)
        when the reduced gradient has a NaN or Inf; ``metrics["skipped"]`` is 1.0 for a skipped
        step, else 0.0. With accumulation the decision is taken on the synchronising call, on the
        whole window's reduced gradient; a skipped window is still consumed.
      compiler_options: XLA options for compiling the step (``jax.jit(compiler_options=...)``),
        e.g. ``jddp.perf.xla_flags.recommended("gpu", cap).compiler_options``.
      accumulate_steps: ``k > 1`` accumulates local gradients over ``k`` calls of ``step`` and
        reduces once, on the ``k``-th (DDP's ``no_sync``); ``step(state, batch, sync=...)``
        chooses explicitly. See docs/accumulate.md.
      microbatches: ``m > 1`` splits each device's batch into ``m`` micro-batches scanned inside
        one step, with one reduction per bucket after the loop.
      accumulator_dtype: dtype of the local gradient sums (default float32, or the parameter dtype
        if wider).
      shard_accumulator: at ``zero_stage`` 2-3 with ``accumulate_steps > 1``, every accumulating
        call reduce-scatters its gradients (one reduce-scatter per bucket) into an accumulator
        split like the parameters, ``P/N`` per device, instead of a full-size local sum on every
        device: memory for bandwidth (``k`` reduce-scatters per window instead of one; FSDP2's
        ``set_requires_gradient_sync`` trade). ``None`` (default): sharded at stages 2-3 when the
        hook reduce-scatters without state and there is no local SGD or ``deterministic``;
        ``False``: the local sum. See docs/accumulate.md.
      zero_stage: sharded data parallelism (ZeRO): 0 replicates parameters, gradients and
        optimizer state on every device (DDP, the default); 1 shards the optimizer state over the
        data axis (each device updates its piece of the parameters, then they are all-gathered);
        2 also reduce-scatters each bucket's gradients from inside the backward pass; 3 also
        keeps only a piece of each parameter, all-gathering each bucket right before its first
        use. Training is the same at every stage, for any optax transformation. See
        docs/sharded.md.
      hybrid_shard: with ``zero_stage >= 1`` on a two-level mesh (``data_mesh(hosts=...)``),
        split the sharded state over the devices of each host only and replicate it across
        hosts (PyTorch FSDP's ``HYBRID_SHARD``, MaxText's FSDP inside a slice and data
        parallelism across): each bucket is reduce-scattered inside the host and its pieces
        all-reduced across hosts, so the slow link carries ``1/L`` of the gradient bytes, and
        parameters are gathered inside the host only. Memory per device falls by the local
        device count ``L`` instead of ``N``. See docs/scaling.md.
      reshard_after_forward: at ``zero_stage=3`` (default ``True``, FSDP's default): each
        gathered parameter is dropped after its forward use and gathered again for the
        backward, so the step's peak holds a few gathered layers, not the model; ``False``
        keeps the gathered buckets from the forward pass until the backward is done (fewer
        gathers, more memory). An int ``k`` (ZeRO++'s hpZ, FSDP2's int): after the forward
        each device keeps a ``1/k`` slice of every gathered parameter, and the backward gathers
        it again over its group of ``k`` consecutive devices only; on a two-level mesh pass
        the devices per host (or a divisor of it), so the backward gathers stay inside the
        host. ``k`` must divide the devices the parameters are sharded over (and, on a
        two-level mesh, the devices per host); ``1`` is ``False`` and that device count
        ``True``. Not accepted at stages 0-2 (nothing is gathered there).
      rng: ``loss_fn`` takes a last argument ``rng``, one PRNG key per example of its shard, and
        ``step(state, batch, rng=key)`` takes the run's key; each example's key is derived from
        the key, ``state.step`` and the example's position in the global batch, so dropout masks
        differ across devices and steps and equal a single device's (``jddp.random``).
      sum_metrics: names of aux metrics to sum over devices and micro-batches instead of
        averaging (counts, token totals); with ``weighted``, arrays shaped like the loss are
        summed over the real entries. No extra collective.
      loss_scale: dynamic loss scaling for float16 training, ``jddp.precision.DynamicScale()``
        (Flax's ``DynamicScale`` rule): the loss is scaled in the backward pass, the reduced
        gradients unscaled; a step with a non-finite gradient is skipped on every replica and
        the scale shrinks, it grows after ``growth_interval`` finite steps.
      mixed_precision: ``jddp.precision.MixedPrecision(param_dtype=..., reduce_dtype=...)``
        (FSDP2's ``MixedPrecisionPolicy``): float32 master parameters and optimizer state,
        forward and backward in ``param_dtype`` (stage 3 gathers it), gradients reduced in
        ``reduce_dtype``; see docs/precision.md.
        ``state.loss_scale`` holds the scale, ``metrics["loss_scale"]`` reports it.
      local_sgd: ``jddp.local_sgd.post_local_sgd(period, start_step)`` or
        ``jddp.local_sgd.diloco(period)``: replicas (the hosts of a two-level mesh, else every
        device) train apart and average their parameters every ``period`` steps; gradients are
        still reduced inside a host every step. ``state.params`` then holds one copy per replica
        (read :meth:`global_params` to evaluate). See docs/scaling.md.
      deterministic: the same parameters, bit for bit, on any power-of-two device count, process
        count, two-level mesh, ``microbatches`` and power-of-two ``accumulate_steps`` split of
        the same global batches: the batch is cut into groups of ``group_size`` examples whose
        gradients are summed in one fixed pairwise tree (fixed-order all-to-all and all-gather
        instead of the bucketed all-reduce). The device count must divide the number of groups.
        With model state, ``model_state_sync="mean"`` (each group starts from the step's state,
        the new state is the groups' mean). See docs/deterministic.md.
      group_size: examples per group with ``deterministic=True`` (default 8).
      verify_every: every ``K`` calls of ``step``, a cheap check that the replicas' parameters
        are still equal (one uint32 hash per parameter and device, one small all-gather; it
        waits for that step): ``jddp.ReplicaDivergenceError`` names the leaf and the replicas
        whose copy differs (silent data corruption, a bad custom hook). See docs/report.md.

    Metrics: ``metrics["loss"]``, the aux metrics, ``"comm_bytes"``, ``"skipped"`` (with
    ``skip_not_finite``, ``weighted`` or ``loss_scale``), and every scalar hyperparameter of an
    ``optax.inject_hyperparams`` optimizer under its name (``"learning_rate"``), read from the
    optimizer state after the update; the names the step writes itself are reserved for it
    (``jddp._src.objective.STEP_METRICS``).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        mesh: Mesh | None = None,
        bucket_cap_mb: float | str | autocap.AutoCap | None = None,
        first_bucket_mb: float | None = None,
        has_aux: bool = False,
        hook: CommHook | None = None,
        bucket_plan: BucketPlan | None = None,
        chain: options.Chain = "auto",
        donate: bool = True,
        model_state_sync: options.ModelStateSync = "broadcast",
        weighted: bool = False,
        keep_unused: bool = False,
        skip_not_finite: bool = False,
        compiler_options: dict[str, Any] | None = None,
        accumulate_steps: int = 1,
        microbatches: int = 1,
        accumulator_dtype: Any = None,
        shard_accumulator: bool | None = None,
        zero_stage: options.ZeroStage = 0,
        hybrid_shard: bool = False,
        reshard_after_forward: bool | int | None = None,
        rng: bool = False,
        sum_metrics: tuple[str, ...] = (),
        loss_scale: ls_lib.DynamicScale | None = None,
        local_sgd: local_sgd_options.LocalSGD | None = None,
        verify_every: int | None = None,
        deterministic: bool = False,
        group_size: int | None = None,
        mixed_precision: precision_lib.MixedPrecision | None = None,
        **renamed: Any,
    ) -> None:
        skip_not_finite, accumulator_dtype = _renamed_arguments(
            renamed, skip_not_finite, accumulator_dtype)
        donate = options.flag(donate, "donate")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        auto, cap, first = _bucket_caps(bucket_cap_mb, first_bucket_mb, bucket_plan)
        det, groups = _deterministic(deterministic, group_size, auto)
        policy, hook = _policy_and_hook(mixed_precision, hook, loss_scale, det)
        config = StepConfig(
            loss_fn=loss_fn,
            optimizer=check_optimizer(optimizer),
            mesh=mesh_lib.check_mesh(mesh_lib.data_mesh() if mesh is None else mesh),
            has_aux=options.flag(has_aux, "has_aux"),
            hook=hook,
            chain=options.chain(chain),
            cap_bytes=cap,
            first_bytes=first,
            fixed_plan=bucket_plan,
            keep_unused=options.flag(keep_unused, "keep_unused"),
            model_state_sync=options.model_state_sync(model_state_sync),
            weighted=options.flag(weighted, "weighted"),
            skip_not_finite=options.flag(skip_not_finite, "skip_not_finite"),
            accumulate_steps=options.count(accumulate_steps, "accumulate_steps"),
            microbatches=options.count(microbatches, "microbatches"),
            accumulator_dtype=options.float_dtype(accumulator_dtype, "accumulator_dtype"),
            shard_accumulator=options.shard_accumulator(
                shard_accumulator, zero_stage=options.zero_stage(zero_stage),
                accumulate_steps=options.count(accumulate_steps, "accumulate_steps"),
                scatters=_scatters_without_state(hook),
                plain=local_sgd is None and not det),
            zero_stage=options.zero_stage(zero_stage),
            hybrid_shard=options.flag(hybrid_shard, "hybrid_shard"),
            reshard_after_forward=options.reshard_after_forward(reshard_after_forward,
                                                                zero_stage),
            rng=options.flag(rng, "rng", " Pass the key itself to step(state, batch, rng=key)."),
            sum_metrics=_sum_metrics(sum_metrics, has_aux),
            loss_scale=ls_lib.check_loss_scale(loss_scale),
            local_sgd=local_sgd_options.check_local_sgd(local_sgd),
            deterministic=det,
            group_size=groups, mixed_precision=policy,
        )
        config = _checked(config, (bucket_cap_mb, first_bucket_mb, bucket_plan) != (None,) * 3)
        every = _verify_every(verify_every)
        self._install_step(config, auto, donate, compiler_options, every)

    def _install_step(self, config: StepConfig, auto: Chooser | None, donate: bool,
                      compiler_options: dict[str, Any] | None, every: int) -> None:
        """Sets ``config``, ``_plans``, ``step`` and ``_auto``: the compiled step of ``config``,
        or with ``bucket_cap_mb="auto"``/``"model"`` the step that chooses its plan first."""
        plans = PlanLog()
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "_plans", plans)

        def make_step(cfg: StepConfig, observer: pipeline.PlanObserver) -> Step:
            return Step(cfg, donate=donate, compiler_options=compiler_options, observer=observer,
                        verify_every=every)

        def chosen(cfg: StepConfig, _: autocap.CapChoice) -> None:
            object.__setattr__(self, "config", cfg)

        # bucket_cap_mb="auto" / "model": the plan is chosen on the first step (timed, see
        # _src/autocap.py; predicted, see _src/modelcap.py), then fixed; the configuration takes
        # the chosen caps.
        step: Step | autocap.AutoStep | modelcap.ModelStep
        if isinstance(auto, modelcap.ModelCap):
            step = modelcap.ModelStep(config, auto, make_step, plans, chosen)
        elif auto is not None:
            step = autocap.AutoStep(config, auto, make_step, plans, chosen)
        else:
            step = make_step(config, plans)
        object.__setattr__(self, "_auto", step if auto is not None else None)
        # Under jddp-run, each call reports its completed step to the launcher's watchdog (a
        # queue append, about 0.6 us); elsewhere this is the step itself.
        object.__setattr__(self, "step", watchdog.reporting(step))

    config: StepConfig
    _plans: PlanLog
    _auto: autocap.AutoStep | modelcap.ModelStep | None
    step: Step | autocap.AutoStep | modelcap.ModelStep
    """The compiled step: ``step(state, batch, mask=None, *, sync=None, rng=None) -> (state,
    metrics)``; ``step.lower(...)`` gives its program."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"DataParallel options are fixed at construction (the step is compiled from them): "
            f"cannot set {name!r}. Build a new jddp.DataParallel(...) with the option you want."
        )

    # Read-only views of the configuration.
    loss_fn = property(lambda self: self.config.loss_fn)
    optimizer = property(lambda self: self.config.optimizer)
    mesh = property(lambda self: self.config.mesh)
    axis_name = property(lambda self: self.config.axis_name)
    hook = property(lambda self: self.config.hook)
    model_state_sync = property(lambda self: self.config.model_state_sync)

    @property
    def num_devices(self) -> int:
        """The number of devices of the data mesh (replicas)."""
        return self.config.num_devices

    @property
    def bucket_plan(self) -> BucketPlan | None:
        """The bucket plan of the most recently traced step (``None`` before the first step)."""
        plan, choice = self._plans.latest, self.cap_choice
        if self._auto is None:  # a fixed cap, or the default plan (its note is its own)
            return plan
        if plan is not None and choice is not None and choice.method == "model":
            plan = plan._replace(note=f"chosen by bucket_cap_mb='model' (cost model, nothing "
                                      f"timed): {choice.note}; pin it with {choice.pin}")
        elif plan is not None and choice is not None:
            n = len(choice.candidates_mb)
            how = (f"from {n} timed caps" if n > 1 else
                   "without timing: every candidate cap gives this one plan")
            plan = plan._replace(note=f"chosen by bucket_cap_mb='auto' {how}; pin it with "
                                      f"bucket_cap_mb={choice.cap_mb:g}")
        return plan

    @property
    def cap_choice(self) -> autocap.CapChoice | None:
        """What ``bucket_cap_mb="auto"`` or ``"model"`` chose (``None`` before the choice, or
        for a fixed cap); ``print`` it for the timings or predictions, the reason and the
        arguments that pin the choice (``cap_choice.pin``). With no cap given, the default
        plan's choice (``method="default"``), made when the step (or ``plan``) is traced."""
        if self._auto is not None:
            return self._auto.choice
        policy = self.config.default_plan
        return policy.latest if isinstance(policy, modelcap.DefaultPlan) else None

    def init(self, params: Any, model_state: Any = None) -> TrainState:
        """Builds the replicated initial state: params, optimizer state, hook state, step 0.

        In a multi-process job every process must pass a tree of the same structure, shapes and
        dtypes (checked), and all start from process 0's values (DDP's initial broadcast).

        Args:
          params: the initial parameters (floating-point leaves).
          model_state: optional non-differentiated model state (e.g. Flax ``batch_stats``).
        """
        checks.check_float_params(params)
        precision_lib.check_master(self.config.mixed_precision, params)
        self._plans.expect(params)
        if self.config.fixed_plan is not None:
            self.config.fixed_plan.check_tree(params)
        ms_lib.check_model_state(model_state, self.config.model_state_sync)
        params, model_state = verify_lib.sync_from_process0((params, model_state), "params")
        shardings = pipeline.state_shardings(
            self.config, jax.eval_shape(self._build, params, model_state)
        )
        return jax.jit(self._build, out_shardings=shardings)(params, model_state)

    def _build(self, params: Any, model_state: Any) -> TrainState:
        return pipeline.build_state(self.config, params, model_state)

    def abstract_state(self, params_like: Any, model_state_like: Any = None) -> TrainState:
        """The TrainState ``init`` would build, as ``jax.ShapeDtypeStruct``s with shardings.

        Nothing is allocated or computed, so this works on meshes of compile-only devices.
        """
        return pipeline.abstract_state(self.config, params_like, model_state_like)

    def plan(self, params: Any, batch: Any, model_state: Any = None, mask: Any = None) -> BucketPlan:
        """The bucket plan the step uses for ``params`` and a global ``batch``, before any step.

        The same planning code as the step's (it traces the step, without compiling it), so it
        works for models that communicate in their forward pass too (cross-replica BatchNorm).
        ``params``, ``batch`` and ``mask`` may be arrays or ``jax.ShapeDtypeStruct``s. With
        ``bucket_cap_mb="auto"``, only once the cap is chosen; with ``"model"``, the cost model
        chooses here if no step has (``cap_choice`` says why).
        """
        if isinstance(self._auto, modelcap.ModelStep):
            self._auto.choose(self.abstract_state(params, model_state), batch, mask)
        elif self._auto is not None:
            self._auto.chosen_step("plan")
        return pipeline.plan(self.config, self.abstract_state(params, model_state), batch, mask)

    def lower(
        self,
        params_like: Any,
        batch_like: Any,
        model_state_like: Any = None,
        *,
        sync: bool | None = None,
        step: int | None = None,
    ) -> jax.stages.Lowered:
        """Lowers the step from abstract (or concrete) params and batch: ``step.lower`` on
        :meth:`abstract_state`. ``.compile().as_text()`` is the compiled HLO; with a mesh of
        compile-only devices (``jddp.perf``) it is the program a GPU or TPU cluster would run.

        Args:
          sync: the accumulation variant (see docs/accumulate.md).
          step: the step whose program to lower, for hooks that change with it (PowerSGD's
            ``start_iter``; default: step 0).
        """
        state = self.abstract_state(params_like, model_state_like)
        return self.step.lower(state, batch_like, sync=sync, step=step)

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
        window = self.config.accumulate_steps if sync is None else 1
        return report_lib.build(compiled, state, mesh_lib.host_of_device(self.config.mesh),
                                window, self._plans.latest)

    def verify(self, state: TrainState, *, atol: float = 0.0) -> None:
        """Raises :class:`jddp.ReplicaDivergenceError` if replicas of ``state`` differ.

        Checks ``step``, ``params``, ``opt_state`` and (unless per-device) ``model_state``; the
        per-device hook and accumulator state are meant to differ, and the leaves a sharded
        stage splits have no replicas to compare. With local SGD, the copies of each replica
        (the devices of a host) and DiLoCo's outer state.
        """
        tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state,
                "loss_scale": state.loss_scale}
        if self.config.model_state_sync != "none":
            tree["model_state"] = state.model_state
        if self.config.local_sgd is not None and not self.config.data_axes.two_level:
            # One replica per device: no two devices hold copies of a replica's leaves.
            tree = {"step": state.step}
        if state.outer is not None:
            tree["outer"] = state.outer
        # With local SGD the per-replica leaves are compared inside each replica (the devices of
        # a host), replicated ones everywhere. At the sharded stages a split leaf has one copy of
        # each piece: nothing to compare.
        mesh_axes = set(self.config.mesh.axis_names)

        def copies(x: Any) -> Any:
            if x.sharding.is_fully_replicated:
                return x
            if self.config.local_sgd is None:
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
        if self.config.local_sgd is None:
            return state.params
        return local_sgd_lib.global_params(self.config, state)
