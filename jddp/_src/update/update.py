"""The update wrappers: accumulation, the skip guards and loss scaling around the optimizer.

As optax's ``MultiSteps`` and ``apply_if_finite`` wrap an optimizer, phase 3 is the inner update
wrapped by :class:`Accumulate` (only a window's closing call updates) and a guard (any
:class:`Guard`: :class:`SkipNotFinite` or :class:`jddp.precision.DynamicScale`), composed once in
:class:`Update`. Each wrapper nests its state's ``inner`` node and replaces only its own
(docs/design.md, phase 3).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jddp._src.api import options
from jddp._src.core import microbatch, zero
from jddp._src.runtime.topology import Roles, Topology
from jddp._src.step.state import AccumState, GuardState, TrainState, own, put
from jddp._src.tree import strip_device_dim
from jddp._src.update import accumulation as acc_lib
from jddp._src.update.nonfinite import Guard, check_node, select_tree

Inner = Callable[[Any, Any, Any], tuple[Any, Any]]
"""``(params, opt_state, grads) -> (params, opt_state)`` of one replica: the optimizer at the
placement, the update the wrappers wrap."""


@dataclasses.dataclass(frozen=True)
class Accumulate:
    """Gradient accumulation: local sums over calls and micro-batches, one reduction per
    window (DDP's ``no_sync``; docs/accumulate.md).

    Attributes:
      steps: ``k > 1`` accumulates over ``k`` calls of ``step`` and reduces on the ``k``-th;
        ``step(state, batch, sync=...)`` chooses explicitly.
      microbatches: ``m > 1`` splits each device's batch into ``m`` micro-batches scanned
        inside one call, with one reduction per bucket after the loop.
      dtype: dtype of the local sums (default float32, or the parameter dtype if wider).
      shard: at ZeRO stages 2-3 with ``steps > 1``, reduce-scatter every call's gradients into
        an accumulator split like the parameters instead of a full local sum. ``None``: sharded
        there when the hook reduce-scatters without state (and not with local SGD or the
        deterministic reduction); ``False``: the local sum.
    """

    steps: int = 1
    microbatches: int = 1
    dtype: Any = None
    shard: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", options.count(self.steps, "Accumulate.steps"))
        object.__setattr__(self, "microbatches",
                           options.count(self.microbatches, "Accumulate.microbatches"))
        object.__setattr__(self, "dtype", options.float_dtype(self.dtype, "Accumulate.dtype"))
        if self.shard is not None:
            object.__setattr__(self, "shard", options.flag(
                self.shard, "Accumulate.shard",
                " None (the default) shards the accumulator at ZeRO stages 2-3 when it can."))
        if self.shard and self.steps == 1:
            raise ValueError("Accumulate(shard=True) reduce-scatters every call's gradients into "
                             "a 1/N accumulator, but steps=1: there is no "
                             "accumulator. Pass steps=k > 1, or shard=None.")

    # -------------------------------------------------------------- the state (its AccumState)

    @property
    def accumulates(self) -> bool:
        """Whether the state carries an accumulator across calls (``steps > 1``)."""
        return self.steps > 1

    @property
    def is_identity(self) -> bool:
        """Whether every call is one micro-batch, reduced at once (no accumulator, no scan)."""
        return self.steps == 1 and self.microbatches == 1

    def init(self, params: Any, num_devices: int, model_state: Any = None) -> AccumState | None:
        """The empty accumulator (``None`` without a window)."""
        if not self.accumulates:
            return None
        return acc_lib.init_accum(params, num_devices, self.dtype, model_state,
                                  sharded=bool(self.shard))

    @staticmethod
    def nest(node: AccumState | None, inner: Any) -> Any:
        """The window's ``node`` nesting the inner wrappers' state ``inner`` (``inner`` itself
        without a window)."""
        return inner if node is None else node.replace(inner=inner)

    def specs(self, accum: AccumState | None, topology: Topology) -> AccumState | None:
        """Partition specs of the accumulator: per device, or its sums split like stage 3's
        parameters when sharded."""
        split = None
        if self.shard:
            split = lambda tree: jax.tree.map(
                lambda x: zero.leaf_spec(jnp.shape(x), topology.shard_count, topology.shard),
                tree)
        return acc_lib.accum_specs(accum, topology.data, split)

    def check(self, state: Any, num_devices: int, hook_name: str) -> None:
        """Trace-time checks that the window's node of ``state.update_state`` is this policy's
        accumulator (and that a sharded one can carry the hook's state: none)."""
        acc_lib.check_accum(state, self.steps, num_devices, bool(self.shard))
        if self.shard and jax.tree.leaves(state.reduce_state):
            # The option probed the hook on one small leaf; a hook with state for these params
            # reduces with that state, which an accumulating call's reduce-scatter cannot carry.
            raise ValueError(
                f"jddp.Accumulate(shard=True) reduce-scatters every call through the hook's "
                f"stateless scatter, but {hook_name!r} keeps state for these parameters. Pass "
                "accumulate=jddp.Accumulate(..., shard=False)."
            )

    def check_call(self, local_size: int, num_devices: int, sync: bool | None) -> None:
        """Trace-time checks of one call: ``sync=False`` needs a window, the micro-batches must
        divide the per-device batch."""
        if sync is False and not self.accumulates:
            raise ValueError(
                "step(..., sync=False) accumulates gradients, which needs an accumulator: create "
                "the DataParallel with accumulate=jddp.Accumulate(steps=k) (k > 1; the k-th call "
                "of step(state, batch) synchronises, or choose with sync=True/False)."
            )
        m = self.microbatches
        if local_size % m:
            raise ValueError(
                f"jddp.Accumulate(microbatches={m}) does not divide the per-device batch of "
                f"{local_size} examples (global batch {local_size * num_devices} on "
                f"{num_devices} devices). Use a global batch that is a multiple of "
                f"{num_devices * m}."
            )

    # -------------------------------------------------------------- the per-device phases

    def split(self, tree: Any) -> tuple[Any, Any]:
        """``(micro, last)``: the call's micro-batches of ``tree`` stacked on a leading axis
        (contiguous rows), and the last one."""
        m = self.microbatches
        if m > 1:
            micro = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), tree)
            return micro, jax.tree.map(lambda x: x[m - 1], micro)
        return jax.tree.map(lambda x: x[None], tree), tree

    def head(self, micro: Any) -> Any:
        """The micro-batches before the last one (of :meth:`split`'s stack)."""
        return jax.tree.map(lambda x: x[: self.microbatches - 1], micro)

    @property
    def scans(self) -> bool:
        """Whether a call sums micro-batches before its last one locally."""
        return self.microbatches > 1

    def sum_dtype(self, param_dtype: Any) -> Any:
        """The dtype of a parameter's local gradient sum."""
        return acc_lib.accumulator_dtype(param_dtype, self.dtype)

    def local_offset(self, live_grads: Any) -> Any:
        """The window's earlier sums added before the reduction: this device's sums of the
        per-device accumulator (``None`` for a sharded one, whose reduced sums are added after
        the reduction: :meth:`add_reduced`)."""
        return None if self.shard else strip_device_dim(live_grads)

    def add_reduced(self, reduced: list, acc: AccumState, seed: Any, unit: float) -> list:
        """``reduced`` plus a sharded accumulator's earlier reduced sums, times ``seed / unit``
        (scaled like this call's gradients); ``reduced`` itself for a per-device one."""
        if not self.shard:
            return reduced
        return [g + (a * jnp.asarray(seed / unit, a.dtype)).astype(g.dtype) for g, a in
                zip(reduced, jax.tree.leaves(microbatch.live(acc)[0]), strict=True)]

    def window_count(self, accum: AccumState | None) -> Any:
        """Micro-batches in the window a synchronising call closes (the mean's denominator):
        static, or read from the counter (a window cut short by ``sync=True`` still averages
        right)."""
        m = self.microbatches
        return float(m) if accum is None else (accum.count + 1).astype(jnp.float32) * m

    def report(self, loss: Any, accum: AccumState | None,
               num_devices: int) -> Callable[[Any], dict]:
        """``mean -> metrics`` of a call that closes the window ``accum`` holds (the loss
        policy's report over the window's micro-batches)."""
        count = self.window_count(accum)
        return lambda mean: loss.report(mean, self.microbatches, count, num_devices)

    def window_metrics(self, accum: AccumState | None, synced: Any) -> dict:
        """``{"synced": ...}`` for a state that carries a window (whether this call reduced)."""
        return {} if accum is None else {"synced": synced}

    def closes(self, count: Any) -> Any:
        """Whether the call at window position ``count`` closes the window (the ``k``-th)."""
        return count + 1 >= self.steps

    def synchronises(self, accum: AccumState | None, sync: bool | None) -> Any:
        """Whether this call reduces: ``True``/``False``, or the replicated counter's answer
        (one program, optax's ``MultiSteps`` semantics)."""
        if accum is None or sync is True:
            return True
        if sync is False:
            return False
        return self.closes(accum.count)

    # -------------------------------------------------------------- the update and the host

    def windowed(self, sync: bool | None) -> bool:
        """Whether the window's counter decides on the device whether this call updates."""
        return self.accumulates and sync is None

    def calls(self, sync: bool | None) -> int:
        """Calls of ``step`` per reduction for a call with this ``sync``."""
        return self.steps if sync is None else 1

    def reducing(self, sync: bool | None) -> bool | None:
        """The ``sync`` of a call that reduces (with a window, the others send nothing)."""
        return True if self.accumulates else sync


def _where_rows(ok: Any, new: jax.Array, old: jax.Array) -> jax.Array:
    """``new`` where ``ok``, else ``old``: one flag for the whole leaf, or with local SGD one per
    replica (``ok[r]`` picks the rows of replica ``r``: its leading block of ``n / r`` rows, one
    per replica or per device)."""
    if jnp.ndim(ok) == 0:
        return jnp.where(ok, new, old)
    r = ok.shape[0]
    rows = new.reshape(r, new.shape[0] // r, *new.shape[1:])
    picked = jnp.where(ok.reshape(r, *(1,) * (rows.ndim - 1)), rows,
                       old.reshape(rows.shape))
    return picked.reshape(new.shape)


def _select(ok: Any, new: TrainState, kept: TrainState, per_replica: bool) -> TrainState:
    """The new state where the update is kept, the old one where it is skipped. With local SGD
    per replica, and ``step`` (the schedule's clock) advances either way."""
    if not per_replica:
        return select_tree(ok, new, kept)
    rows = lambda a, b: jax.tree.map(functools.partial(_where_rows, ok), a, b)
    return new.replace(
        params=rows(new.params, kept.params), opt_state=rows(new.opt_state, kept.opt_state),
        model_state=rows(new.model_state, kept.model_state),
        reduce_state=rows(new.reduce_state, kept.reduce_state),
    )


@dataclasses.dataclass(frozen=True)
class Update:
    """The wrappers of one step's update, composed once: the window outside, the guards inside.

    Attributes:
      guard: any :class:`Guard` (:class:`SkipNotFinite`, ``DynamicScale``); ``None``: neither.
      skip_empty: skip a window without a real example (``Loss(weighted=True)``).
    """

    accumulate: Accumulate = Accumulate()
    guard: Guard | None = None
    skip_empty: bool = False

    @property
    def skips(self) -> bool:
        """Whether a synchronising call can skip its update (and reports ``"skipped"``)."""
        return self.guard is not None or self.skip_empty

    # -------------------------------------------------------------- the nested state

    @staticmethod
    def window(chain: Any) -> AccumState | None:
        """The accumulation window's node of ``update_state`` (without its inner state)."""
        return own(chain, AccumState)

    @staticmethod
    def guard_state(chain: Any) -> GuardState | None:
        """The guard's node of ``update_state`` (the loss scale's), or ``None``."""
        return own(chain, GuardState)

    def seed(self, chain: Any) -> Any:
        """The cotangent seed of this call's backward pass (the loss scale; ``None``: 1)."""
        return None if self.guard is None else self.guard.seed(self.guard_state(chain))

    def init(self, accum: AccumState | None) -> Any:
        """The wrappers' initial ``update_state``: the window's ``accum`` (the reducer lays it
        out) nesting the guard's initial node (the loss scale's); ``None`` with neither."""
        return self.accumulate.nest(accum, None if self.guard is None else self.guard.init())

    def specs(self, state: TrainState, topology: Topology) -> dict:
        """Partition specs of ``update_state``, ``{"update_state": ...}``: the accumulator's
        (:meth:`Accumulate.specs`) nesting the guard's, replicated."""
        chain = state.update_state
        guard = jax.tree.map(lambda _: P(), self.guard_state(chain))
        window = self.accumulate.specs(self.window(chain), topology)
        return {"update_state": self.accumulate.nest(window, guard)}

    def check(self, state: Any) -> None:
        """Trace-time check of the guard's node of ``state.update_state``."""
        check_node(self.guard_state(state.update_state), self.guard)

    def runs(self, sync: bool | None) -> bool | None:
        """Whether a call with this ``sync`` updates (and advances ``state.step``): ``False``
        for an accumulating call, ``None`` where the device decides (the window's counter, or a
        guard), else ``True``. The host reads the next step from it, phase 3 applies it."""
        if self.accumulate.accumulates and sync is False:
            return False
        if self.accumulate.windowed(sync) or self.skips:
            return None
        return True

    def following(self, step: int, sync: bool | None) -> int | None:
        """``state.step`` after a call at ``step`` (``None``: decided on the device)."""
        runs = self.runs(sync)
        return None if runs is None else step + int(runs)

    def _checks(self, lv: Roles, res: Any) -> tuple[Any, Any]:
        """``(ok, finite)``: whether the update is applied (``None``: always) and whether the
        reduced gradients are finite (``None``: not checked); one flag per replica with local
        SGD."""
        checks = []
        finite = None
        if self.guard is not None:
            # Reduced gradients are identical on every device of a replica: so is this decision.
            finite = lv.per_replica(self.guard.keeps)(res.grads)
            checks.append(finite)
        if self.skip_empty:
            checks.append(lv.flags(res.nonempty))
        ok = functools.reduce(jnp.logical_and, checks) if checks else None
        return ok, finite

    def apply(self, inner: Inner, lv: Roles, state: TrainState, res: Any,
              sync: bool | None) -> tuple[TrainState, dict]:
        """Phase 3 (global view): ``inner`` on the reduced gradients (per replica with local
        SGD), run only by a window's synchronising call (``MultiSteps``), a skipped update
        keeping the whole old state (``apply_if_finite``), then the loss scale's update.

        Args:
          res: the per-device phases' result (``grads``, ``model_state``, ``hook_state``,
            ``accum``, ``synced``, ``nonempty``).

        Returns the new state and the update's metrics.
        """
        metrics: dict = {}
        chain = state.update_state
        node = self.guard_state(chain)
        seed = self.seed(chain)
        if seed is not None:
            metrics["loss_scale"] = seed  # the scale this call's gradients used
        flag_shape = lv.flag_shape
        if self.runs(sync) is False:
            if self.skips:  # nothing applied, nothing skipped
                metrics["skipped"] = jnp.zeros(flag_shape, jnp.float32)
            return state.replace(update_state=put(chain, AccumState, res.accum)), metrics
        # The window's node is left out of the selections below: selecting it would copy the
        # donated sums; it is put back last.
        outside = put(chain, AccumState, None)

        def update() -> TrainState:
            params, opt_state = lv.per_replica(inner)(state.params, state.opt_state, res.grads)
            return state.replace(
                step=state.step + 1, params=params, opt_state=opt_state,
                model_state=res.model_state, reduce_state=res.hook_state, update_state=outside,
            )

        kept = state.replace(update_state=outside)
        ok, finite = self._checks(lv, res)

        def guarded() -> TrainState:
            new = update()
            return new if ok is None else _select(ok, new, kept, lv.islands)

        windowed = self.accumulate.windowed(sync)
        # Only the synchronising calls run the optimizer.
        new_state = lax.cond(res.synced, guarded, lambda: kept) if windowed else guarded()
        if ok is not None:
            metrics["skipped"] = jnp.where(
                jnp.logical_and(res.synced, jnp.logical_not(ok)), 1.0, 0.0
            ).astype(jnp.float32)
        if self.guard is not None and node is not None and finite is not None:
            # Outside the selection above: a skipped step is exactly when the scale must shrink.
            new_node = lv.per_replica(self.guard.update)(node, finite)
            if windowed:
                new_node = select_tree(res.synced, new_node, node)
            new_state = new_state.replace(
                update_state=put(new_state.update_state, GuardState, new_node))
        return new_state.replace(
            update_state=self.accumulate.nest(res.accum, new_state.update_state)), metrics
