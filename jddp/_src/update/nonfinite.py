"""The update guards: skipping steps whose reduced gradient is not finite
(``loss_scale=jddp.SkipNotFinite()``), and the :class:`Guard` base every guard subclasses.

Decided on the reduced gradients, identical on every replica: no collective. Not
``optax.apply_if_finite``: inside the optimizer it would still replace the model and hook state
and advance ``state.step``, apply after ``max_consecutive_errors``, and change ``opt_state``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jddp._src.step.state import GuardState


@dataclasses.dataclass(frozen=True)
class Guard:
    """Base of the update guards (``loss_scale=``): a synchronising call whose reduced gradients
    are not finite is skipped whole (params, optimizer, model and hook state, ``state.step``).

    A guard with state owns one node of ``TrainState.update_state``, of the type ``node`` (a
    :class:`jddp._src.step.state.GuardState` struct dataclass with an ``inner`` field), and
    overrides the methods below; the defaults are a guard without state (:class:`SkipNotFinite`).
    A subclass needs no registration: ``loss_scale=`` takes any ``Guard``.
    """

    node: ClassVar[type[GuardState] | None] = None

    def init(self) -> GuardState | None:
        """The guard's node of the first step's ``update_state`` (``None``: no state)."""
        return None

    def keeps(self, grads: Any) -> jax.Array:
        """Whether the step with these reduced gradients (one replica's) is applied: a bool
        scalar, the same on every device of the replica (default: all of them finite)."""
        return all_finite(grads)

    def seed(self, node: Any) -> Any:
        """The cotangent seed of the reducing backward pass (the loss scale; ``None``: 1). The
        reducer divides the reduced gradients by it again."""
        del node
        return None

    def update(self, node: Any, finite: jax.Array) -> Any:
        """The node after a synchronising call that :meth:`keeps` applied (``finite``) or not;
        runs whether or not the step was skipped."""
        del finite
        return node


@dataclasses.dataclass(frozen=True)
class SkipNotFinite(Guard):
    """The update guard that skips a step whose reduced gradient has a NaN or Inf (optax's
    ``apply_if_finite``): params, optimizer, model and hook state and ``state.step`` stay,
    ``metrics["skipped"]`` is 1.0. With accumulation the whole window's gradient decides; a
    skipped window is consumed. ``jddp.precision.DynamicScale()`` skips such steps too (and
    scales)."""


def check_node(node: GuardState | None, guard: Guard | None) -> None:
    """Trace-time check that the guard's node of ``state.update_state`` matches the trainer's
    ``loss_scale`` option (the state was built by another trainer otherwise)."""
    want = None if guard is None else guard.node
    if want is not None and not isinstance(node, want):
        raise ValueError(
            f"This DataParallel's loss_scale={type(guard).__name__}(...) keeps a {want.__name__} "
            f"in state.update_state, but state.loss_scale is None (no {want.__name__} there): "
            "build the state with this DataParallel's init() (or restore it with its "
            "abstract_state())."
        )
    if want is None and node is not None:
        raise ValueError(
            f"state.loss_scale (in state.update_state) holds a {type(node).__name__} but this "
            "DataParallel has no loss_scale option that keeps one; use the DataParallel that "
            "built the state."
        )


def all_finite(tree: Any) -> jax.Array:
    """A bool scalar: every floating-point element of ``tree`` is finite (True for no leaves)."""
    flags = [
        jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where the scalar ``pred`` holds, else ``on_false``, leaf by leaf."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
