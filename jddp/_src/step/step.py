"""``ddp.step``: the compiled training step, and what happens on the host around each call."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.api import options
from jddp._src.plan.planner import BucketPlan, unused_message
from jddp._src.reduce import xla_options
from jddp._src.runtime import verify as verify_lib
from jddp._src.step import checks, programs, skeleton
from jddp._src.step.config import StepConfig
from jddp._src.step.state import TrainState


class PlanLog:
    """The plans a step was traced with: the latest one, and the unused-parameter warning once.

    DDP searches for unused parameters on every iteration (``find_unused_parameters``); here the
    question is answered once per compile, from the traced loss, and reported once per trainer.
    """

    def __init__(self) -> None:
        self.latest: BucketPlan | None = None
        self.planned: BucketPlan | None = None  # the latest ddp.plan(...)
        self._warned = False
        self.params_paths: tuple[str, ...] | None = None  # the tree ddp.init was last given

    def expect(self, params: Any) -> None:
        """Records the model's params tree (``init``'s), to name a state of another model."""
        self.params_paths = checks.params_paths(params)

    def check_state(self, state: Any) -> None:
        """Trace-time: ``state`` is a TrainState whose params have the model's tree."""
        checks.check_train_state(state, TrainState)
        if self.params_paths is not None:
            checks.check_same_params_tree(self.params_paths, state.params)

    def record(self, plan: BucketPlan) -> None:
        """Records a plan traced outside the step (``ddp.plan``): ``planned``, not ``latest``."""
        self.planned = plan

    def __call__(self, plan: BucketPlan) -> None:
        self.latest = plan
        if plan.unused and not self._warned:
            self._warned = True
            warnings.warn(unused_message([plan.paths[i] for i in plan.unused]), stacklevel=2)


def _check_live(state: Any) -> None:
    """A clear error, before dispatch, for a state whose buffers a previous step consumed.

    Passing a donated state again would crash the process on several devices (XLA:CPU
    segfaults), so this runs before every call; every leaf is deleted together, so the step
    counter stands for all (checking each leaf cost 3% of a small step).
    """
    is_deleted = getattr(getattr(state, "step", None), "is_deleted", None)
    if is_deleted is not None and is_deleted():
        raise ValueError(
            "This TrainState was consumed by an earlier step: step() donates its input state's "
            "buffers to the new state (like an in-place update), so the old one cannot be used "
            "again. Use the state that step returned (state, metrics = ddp.step(state, batch)), "
            "or build the DataParallel with donate=False to keep inputs alive."
        )


class Step:
    """``ddp.step(state, batch, mask=None, *, sync=None, rng=None) -> (state, metrics)``, compiled.

    One object for every configuration: hooks whose collectives change with the step
    (``CommHook.phase``, e.g. PowerSGD's start) get one compiled program per phase, chosen on the
    host from the step counter, which is remembered for states this object returned, so a training
    loop does not wait on the device. ``lower`` gives the program a call would run.

    Args:
      cfg: the step's configuration.
      donate: donate the input state's buffers to the output (the input is consumed).
      compiler_options: XLA options for ``jax.jit``.
      observer: called with the bucket plan whenever the step is traced.
      verify_every: every this many calls, compare a hash of each parameter's copies across
        replicas and raise ``ReplicaDivergenceError`` on a mismatch (0: never).
    """

    def __init__(
        self,
        cfg: StepConfig,
        *,
        donate: bool = True,
        compiler_options: dict[str, Any] | None = None,
        observer: skeleton.PlanObserver | None = None,
        verify_every: int = 0,
    ) -> None:
        self._cfg = cfg
        self._verify_every = int(verify_every)
        self._calls = 0
        self._donate = donate
        self._traced_plan: BucketPlan | None = None

        def observe(plan: BucketPlan) -> None:
            self._traced_plan = plan
            if observer is not None:
                observer(plan)

        def traced(state: Any, *args: Any, **kwargs: Any) -> Any:
            # Runs when jit traces, not per call: a dict, or a state of another model, is named
            # here instead of failing inside the step or the user's loss.
            if isinstance(observer, PlanLog):
                observer.check_state(state)
            else:
                checks.check_train_state(state, TrainState)
            return skeleton.train_step(cfg, observe, state, *args, **kwargs)

        self._traced = traced
        self._compiler_options = compiler_options
        self._jit_fn: Any = None  # built on the first call or lower (see _jit)
        self._options_used: dict[str, Any] = {}
        self._phase_fn = skeleton.step_phase(cfg)
        self._sync_ctx = skeleton.sync_context(cfg)  # for the sync policy's host hooks
        # Input signatures already checked to agree across processes, and the programs (input
        # signature, sync, phase) whose collectives were (multi-process runs only).
        self._agreed: set[tuple] = set()
        self._checked: set[tuple] = set()
        self._known: tuple[Any, int] | None = None  # (weakref to a returned step array, its value)
        self._last_phase: Any = None

    @property
    def _jit(self) -> Any:
        assert self._jit_fn is not None, "call _build_jit(state) first"
        return self._jit_fn

    def _build_jit(self, state: Any) -> None:
        """The jitted step, built once the parameters' sizes are known (first call or lower).

        On GPU the compiler options keep one planned bucket one collective (:mod:`xla_options`).
        """
        if self._jit_fn is not None:
            return
        cfg = self._cfg
        given = self._compiler_options
        options_ = dict(given or {})
        platform = cfg.mesh.devices.flat[0].platform
        largest = cfg.reduce.largest_bucket(platform, getattr(state, "params", None))
        if largest is not None:
            options_ = xla_options.step_options(platform, largest, sharded=cfg.place.sharded,
                                                given=given)
        self._options_used = options_
        self._jit_fn = jax.jit(
            self._traced,
            donate_argnums=(0,) if self._donate else (),
            static_argnames=("sync", "phase"),
            compiler_options=options_ or None,
        )

    @property
    def compiler_options(self) -> dict[str, Any] | None:
        """The options the step is compiled with (``None`` before its first call or lower)."""
        if self._jit_fn is None:
            return None
        return dict(self._options_used)

    @property
    def config(self) -> StepConfig:
        """The configuration this step was compiled from."""
        return self._cfg

    @property
    def donates(self) -> bool:
        """Whether a call consumes its input state."""
        return self._donate

    def _host_step(self, state: Any) -> int:
        step = getattr(state, "step", None)
        if self._known is not None and self._known[0]() is step:
            return self._known[1]
        if isinstance(step, jax.ShapeDtypeStruct):
            return 0
        return int(jax.device_get(step))

    def __call__(
        self, state: TrainState, batch: Any, mask: Any = None, *, sync: bool | None = None,
        rng: Any = None,
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One step; ``rng`` is the run's PRNG key with ``jddp.Loss(rng=True)``."""
        out = self._run(state, batch, mask, sync, rng)
        if self._verify_every:
            self._calls += 1
            if self._calls % self._verify_every == 0:
                # Waits for this step first: with simulated CPU devices, a second executable
                # with collectives dispatched while the step's are in flight can deadlock (seen
                # here: half the devices in each). Once every K calls.
                jax.block_until_ready(out)
                verify_lib.check_every({"params": out[0].params}, self._cfg.mesh, self._calls)
        return out

    def _run(
        self, state: TrainState, batch: Any, mask: Any, sync: bool | None, rng: Any
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        if self._donate:
            _check_live(state)
        checks.check_concrete_state(state)
        # Sync policies with a host part (islands: jddp._src.sync.islands) see each step's input.
        before = getattr(self._cfg.sync, "before_step", None)
        if before is not None:
            state = before(self._sync_ctx, state, batch, mask)
        sync = options.step_sync(sync, self._cfg.accumulate.steps)
        if self._jit_fn is None:
            self._build_jit(state)
        if self._phase_fn is None:
            if jax.process_count() > 1:
                self._check_program(state, batch, mask, rng, {"sync": sync})
            return self._call(state, batch, mask, rng, sync=sync)
        step = self._host_step(state)
        phase = self._phase_fn(step)
        if jax.process_count() > 1:
            self._check_program(state, batch, mask, rng, {"sync": sync, "phase": phase})
        if phase != self._last_phase:
            # Switching executables: let the previous step finish first. With simulated CPU
            # devices, two executables with collectives in flight at once were seen to deadlock.
            jax.block_until_ready(state)
            self._last_phase = phase
        new_state, metrics = self._call(state, batch, mask, rng, sync=sync, phase=phase)
        after = getattr(self._cfg.sync, "after_step", None)
        if after is not None:
            new_state = after(self._sync_ctx, phase, new_state)
        # The update's own rule (None: decided on the device; read it back next time).
        following = self._cfg.update.following(step, sync)
        self._known = None if following is None else (weakref.ref(new_state.step), following)
        return new_state, metrics

    def _call(self, state: Any, batch: Any, mask: Any, rng: Any, **static: Any) -> Any:
        """The jitted step; inputs on devices that are not the mesh's get an error naming the
        fix instead of JAX's "incompatible devices" (checked only when JAX raises)."""
        try:
            return self._jit(state, batch, mask, rng, **static)
        except ValueError as e:
            error = (checks.placement_error(state, batch, mask, self._cfg.mesh)
                     if "incompatible devices" in str(e) else None)
            if error is None:
                raise
            raise error from e

    def _check_program(self, state: Any, batch: Any, mask: Any, rng: Any, static: dict) -> None:
        """Before the first run of each program: the same batch shapes and the same collectives
        on every process (:mod:`jddp._src.step.programs`); compiled with the call's arguments,
        so the call reuses it.
        """
        signature = self._check_processes_agree(batch, mask)
        key = (signature, tuple(sorted(static.items())))
        if key in self._checked:
            return
        compiled = self._jit.lower(state, batch, mask, rng, **static).compile()
        programs.check_across_processes(programs.signature(compiled, self._traced_plan))
        self._checked.add(key)

    def _check_processes_agree(self, batch: Any, mask: Any) -> tuple:
        """Every process must pass the same global batch shapes; checked once per signature
        (else they compile different programs and train on wrong data or hang).
        """
        signature = tuple((np.shape(x), str(np.result_type(x))) for x in
                          jax.tree.leaves((batch, mask)))
        if signature in self._agreed:
            return signature
        verify_lib.check_processes_agree(
            {"batch": batch, "mask": mask}, "global batch shapes",
            "Every process must pass the same global batch (same leaves, shapes and dtypes), e.g. "
            "jddp.shard_batch, or jddp.distributed.global_batch_from_local with the same "
            "per-process batch size everywhere.",
        )
        self._agreed.add(signature)
        return signature

    def cache_size(self) -> int:
        """How many programs this step has compiled: one per input shape and static variant
        (``sync``, hook phase); a training loop should see it stay constant."""
        if self._jit_fn is None:
            return 0
        return int(self._jit._cache_size())  # jax's own count

    def lower(
        self, state: Any, batch: Any, mask: Any = None, *, sync: bool | None = None,
        step: int | None = None, rng: Any = None,
    ) -> jax.stages.Lowered:
        """Lowers the program ``self(state, batch, mask, sync=sync)`` would run.

        Args:
          state: a TrainState, or its shape structs (``ddp.abstract_state``).
          batch: a global batch, or shape structs of one (placed on the data axes if they carry no
            sharding).
          step: the step whose program to lower, for hooks whose program changes with it
            (default: ``state.step``, or 0 for an abstract state).
          rng: the key (or its shape struct), with ``Loss(rng=True)`` (default: ``jax.random.key(0)``).
        """
        sync = options.step_sync(sync, self._cfg.accumulate.steps)
        # The same static arguments as __call__'s, so that a call reuses this compile.
        static: dict[str, Any] = {"sync": sync}
        if self._phase_fn is not None:
            static["phase"] = self._phase_fn(self._host_step(state) if step is None else int(step))
        sharding = NamedSharding(self._cfg.mesh, P(self._cfg.topology.data))

        def place(x: Any) -> Any:
            if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            if isinstance(x, jax.ShapeDtypeStruct | jax.Array):
                return x
            return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding)

        batch, mask = jax.tree.map(place, (batch, mask))
        if self._cfg.loss.rng and rng is None:
            rng = jax.random.key(0)  # only its shape and dtype matter
        self._build_jit(state)
        return self._jit.lower(state, batch, mask, rng, **static)
