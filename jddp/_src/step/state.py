"""The training state: immutable pytrees that a step reads and returns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from flax import struct


@struct.dataclass
class AccumState:
    """Local gradient accumulation state (``TrainState.accum``).

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

    ``grads``, ``loss``, ``weight`` and ``model_state`` hold the window's values only while
    ``count > 0``: a synchronising step resets just the counter and leaves stale values in the
    buffers (rewriting them would cost a copy of the accumulator), which the next step ignores.
    """

    count: jax.Array
    grads: Any
    loss: jax.Array
    weight: jax.Array
    model_state: Any = None

    if TYPE_CHECKING:  # flax.struct adds ``replace`` at run time; declared for type checkers.

        def replace(self, **updates: Any) -> AccumState: ...


@struct.dataclass
class LossScaleState:
    """Dynamic loss scaling state (``TrainState.loss_scale``), replicated.

    Attributes:
      scale: float32 scalar, the factor the loss is multiplied by before differentiation.
      fin_steps: int32 scalar, synchronising steps in a row with finite gradients since the
        scale last changed (Flax's ``DynamicScale.fin_steps``).
    """

    scale: jax.Array
    fin_steps: jax.Array

    if TYPE_CHECKING:

        def replace(self, **updates: Any) -> LossScaleState: ...


@struct.dataclass
class OuterState:
    """DiLoCo's outer state (``TrainState.outer``): the global parameters and the outer optimizer.

    Attributes:
      params: the parameters every replica started its current period from (replicated); the
        outer optimizer moves them along the averaged parameter delta.
      opt_state: the outer optimizer's state (replicated; Nesterov momentum by default).
    """

    params: Any
    opt_state: Any

    if TYPE_CHECKING:

        def replace(self, **updates: Any) -> OuterState: ...


@struct.dataclass
class TrainState:
    """Everything a training step reads and writes; an immutable pytree.

    Attributes:
      step: number of optimizer updates applied (int32 scalar).
      params: the model parameters, replicated on every device.
      opt_state: the optimizer state, replicated.
      model_state: non-differentiated model state (e.g. Flax ``batch_stats``), or ``None``;
        replicated, except with ``jddp.Loss(model_state_sync="none")``: one copy per device (leading device
        dimension, like ``hook_state``).
      hook_state: per-device communication-hook state, one entry per parameter leaf, each leaf with
        a leading device dimension (sharded over the data axis).
      accum: local gradient accumulation state (:class:`AccumState`), or ``None`` when not
        accumulating over calls.
      loss_scale: dynamic loss scaling state (:class:`LossScaleState`), or ``None`` without
        ``DataParallel(loss_scale=...)`` (states and checkpoints then keep their structure).
      outer: DiLoCo's :class:`OuterState`, or ``None``. With local SGD or DiLoCo
        (``DataParallel(sync=jddp.local_sgd.diloco(...))``) ``params``, ``opt_state`` and ``model_state`` hold one
        copy per replica (a leading replica dimension, sharded over the replica axis: the hosts of
        a two-level mesh, every device of a 1-D one).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None
    hook_state: Any = ()
    accum: AccumState | None = None
    loss_scale: LossScaleState | None = None
    outer: OuterState | None = None

    if TYPE_CHECKING:

        def replace(self, **updates: Any) -> TrainState: ...
