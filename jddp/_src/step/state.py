"""The training state: immutable pytrees that a step reads and returns.

:class:`TrainState` has one field per policy role, never one per feature; like optax's wrappers,
each update wrapper's state nests the state of the wrapper inside it in its ``inner`` field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
from flax import struct

N = TypeVar("N")


@struct.dataclass
class AccumState:
    """Local gradient accumulation state: :class:`jddp.Accumulate`'s node of
    ``TrainState.update_state`` (the outermost update wrapper's).

    Attributes:
      count: int32 scalar, replicated: calls accumulated since the last synchronisation.
      grads: a tree like params of each device's local gradient sum, with a leading device
        dimension (sharded over the data axis).
      loss: ``float32[num_devices]``: each device's sum of its micro-batch losses in the window
        (with ``weighted``, of its weighted loss numerators).
      weight: ``float32[num_devices]``: each device's sum of micro-batch weights in the window (the
        number of micro-batches; with ``weighted``, of its real-example weights), the denominator
        of the window's mean.
      model_state: each device's model state after its last no-sync call (leading device
        dimension), or ``None`` for models without model state. No-sync calls update model state
        locally (without a collective); the window's synchronising call continues from it and
        synchronises the result into ``TrainState.model_state``.
      inner: the state of the update wrapper inside the window (the loss scale's
        :class:`LossScaleState`), or ``None``.

    ``grads``, ``loss``, ``weight`` and ``model_state`` hold the window's values only while
    ``count > 0``: a synchronising step resets just the counter and leaves stale values in the
    buffers (rewriting them would cost a copy of the accumulator), which the next step ignores.
    """

    count: jax.Array
    grads: Any
    loss: jax.Array
    weight: jax.Array
    model_state: Any = None
    inner: Any = None

    if TYPE_CHECKING:  # flax.struct adds ``replace`` at run time; declared for type checkers.

        def replace(self, **updates: Any) -> AccumState: ...


class GuardState:
    """Base of an update guard's node of ``TrainState.update_state`` (a struct dataclass with an
    ``inner`` field). It is replicated, and with local SGD one per replica: the sync policy lays
    out every ``GuardState`` that way without knowing the guard."""


@struct.dataclass
class LossScaleState(GuardState):
    """Dynamic loss scaling state, replicated: :class:`jddp.precision.DynamicScale`'s node of
    ``TrainState.update_state``.

    Attributes:
      scale: float32 scalar, the factor the loss is multiplied by before differentiation.
      fin_steps: int32 scalar, synchronising steps in a row with finite gradients since the
        scale last changed (Flax's ``DynamicScale.fin_steps``).
      inner: the state of a wrapper inside the loss scale (none today: ``None``).
    """

    scale: jax.Array
    fin_steps: jax.Array
    inner: Any = None

    if TYPE_CHECKING:

        def replace(self, **updates: Any) -> LossScaleState: ...


@struct.dataclass
class OuterState:
    """DiLoCo's outer state (``TrainState.sync_state``): the global parameters and the outer
    optimizer.

    Attributes:
      params: the parameters every replica started its current period from (replicated); the
        outer optimizer moves them along the averaged parameter delta.
      opt_state: the outer optimizer's state (replicated; Nesterov momentum by default).
    """

    params: Any
    opt_state: Any

    if TYPE_CHECKING:

        def replace(self, **updates: Any) -> OuterState: ...


def find(chain: Any, kind: type[N]) -> N | None:
    """The node of type ``kind`` in a chain of nested wrapper states (each holding the next in
    ``inner``), with its ``inner`` state; ``None`` when the chain has none."""
    while chain is not None:
        if isinstance(chain, kind):
            return chain
        chain = getattr(chain, "inner", None)
    return None


def own(chain: Any, kind: type[N]) -> N | None:
    """The node of type ``kind`` without its ``inner`` state: what its owner reads and writes."""
    node = find(chain, kind)
    return None if node is None else node.replace(inner=None)  # type: ignore[attr-defined]


def put(chain: Any, kind: type[N], node: N | None) -> Any:
    """``chain`` with its node of type ``kind`` replaced by ``node`` (``None``: removed), the
    replaced node's ``inner`` state passed through unchanged."""
    if isinstance(chain, kind):
        inner = chain.inner  # type: ignore[attr-defined]
        return inner if node is None else node.replace(inner=inner)  # type: ignore[attr-defined]
    if chain is None:
        if node is not None:
            raise ValueError(f"the update state has no {kind.__name__} to replace")
        return None
    return chain.replace(inner=put(chain.inner, kind, node))


def map_node(chain: Any, kind: type[N], fn: Callable[[Any], Any]) -> Any:
    """``chain`` with ``fn`` applied to its node of type ``kind`` (the node's ``inner`` state
    passes through unchanged); ``chain`` itself when it has none."""
    node = own(chain, kind)
    return chain if node is None else put(chain, kind, fn(node))


@struct.dataclass
class TrainState:
    """Everything a training step reads and writes; an immutable pytree with one field per
    policy role.

    Attributes:
      step: number of optimizer updates applied (int32 scalar).
      params: the model parameters, replicated on every device.
      opt_state: the optimizer state, replicated.
      model_state: non-differentiated model state (e.g. Flax ``batch_stats``), or ``None``;
        replicated, except with ``jddp.Loss(model_state_sync="none")``: one copy per device
        (leading device dimension, like ``reduce_state``).
      reduce_state: the reducer's state: the communication hook's per-device state, one entry
        per parameter leaf, each leaf with a leading device dimension (sharded over the data
        axis); ``()`` for a stateless hook.
      update_state: the update wrappers' states, each nesting the next one's in ``inner``
        (outermost first): :class:`AccumState` with ``jddp.Accumulate(steps=k > 1)``, then
        :class:`LossScaleState` with ``loss_scale=jddp.precision.DynamicScale()``; ``None``
        with neither.
      sync_state: the sync policy's state: DiLoCo's :class:`OuterState`, or ``None``. With local
        SGD or DiLoCo (``DataParallel(sync=jddp.local_sgd.diloco(...))``) ``params``,
        ``opt_state`` and ``model_state`` hold one copy per replica (a leading replica
        dimension, sharded over the replica axis: the hosts of a two-level mesh, every device of
        a 1-D one).

    The read-only properties ``hook_state``, ``accum``, ``loss_scale`` and ``outer`` are views of
    these fields (the nested nodes; not pytree children, not in checkpoints).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None
    reduce_state: Any = ()
    update_state: Any = None
    sync_state: Any = None

    if TYPE_CHECKING:

        def replace(self, **updates: Any) -> TrainState: ...

    @property
    def hook_state(self) -> Any:
        """View: the communication hook's per-device state (``reduce_state``)."""
        return self.reduce_state

    @property
    def accum(self) -> AccumState | None:
        """View: the accumulation window's node of ``update_state`` (with its ``inner``), or
        ``None``."""
        return find(self.update_state, AccumState)

    @property
    def loss_scale(self) -> LossScaleState | None:
        """View: the loss scale's node of ``update_state``, or ``None``."""
        return find(self.update_state, LossScaleState)

    @property
    def outer(self) -> OuterState | None:
        """View: DiLoCo's outer state (``sync_state``), or ``None``."""
        return self.sync_state if isinstance(self.sync_state, OuterState) else None


# The fields of TrainState before its state was nested per policy role, in their order: the
# layout of checkpoints saved by earlier versions (jddp._src.runtime.checkpoint converts them).
LEGACY_FIELDS = ("step", "params", "opt_state", "model_state", "hook_state", "accum",
                 "loss_scale", "outer")


def to_legacy(state: TrainState) -> dict:
    """``state`` in the per-feature layout of earlier checkpoints (a dict of their fields)."""
    acc, scale = own(state.update_state, AccumState), own(state.update_state, LossScaleState)
    return {
        "step": state.step, "params": state.params, "opt_state": state.opt_state,
        "model_state": state.model_state, "hook_state": state.reduce_state,
        "accum": None if acc is None else {
            "count": acc.count, "grads": acc.grads, "loss": acc.loss, "weight": acc.weight,
            "model_state": acc.model_state},
        "loss_scale": None if scale is None else {"scale": scale.scale,
                                                  "fin_steps": scale.fin_steps},
        "outer": state.sync_state,
    }


def from_legacy(old: dict) -> TrainState:
    """The :class:`TrainState` of a dict in the layout of :func:`to_legacy`."""
    scale = old["loss_scale"]
    chain: Any = None if scale is None else LossScaleState(scale["scale"], scale["fin_steps"])
    if old["accum"] is not None:
        chain = AccumState(**old["accum"], inner=chain)
    return TrainState(step=old["step"], params=old["params"], opt_state=old["opt_state"],
                      model_state=old["model_state"], reduce_state=old["hook_state"],
                      update_state=chain, sync_state=old["outer"])
