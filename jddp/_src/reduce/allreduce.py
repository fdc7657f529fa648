"""What a bucket's backward does (:class:`BucketReducer`), and the plain one: the hook's
all-reduce (:class:`AllReduce`, ZeRO stages 0-1). The sharded stages' reducers are in
:mod:`jddp._src.reduce.sharded`; :func:`jddp._src.reduce.backward.bucketed_vjp` puts one custom
VJP per bucket around any of them (docs/design.md, "Reducers")."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import jax

from jddp._src.core import recorder
from jddp._src.core.collectives import axis_size, levels
from jddp._src.introspect import vma
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce import bytemodel
from jddp._src.reduce.hooks import CommHook, HookContext, check_output, check_reduced, check_state
from jddp._src.tree import chain_dependency


class BucketReducer(Protocol):
    """How a bucket's parameters reach the loss (``forward``) and how its gradients are reduced
    (``backward``); what the collectives of either send is recorded as they are issued
    (:mod:`jddp._src.core.recorder`).
    :func:`jddp._src.reduce.backward.bucketed_vjp` puts one custom VJP per bucket around any
    reducer; see docs/design.md, "Adding a reducer"."""

    @property
    def axis_name(self) -> Any: ...  # the axes the mean is over
    @property
    def prefetch(self) -> bool: ...  # the forward moves data: issue it one bucket ahead

    def out_struct(self, i: int) -> jax.ShapeDtypeStruct: ...
    def check(self, leaves: Sequence[Any]) -> None: ...
    def forward(self, b: int, leaves: tuple) -> tuple: ...
    def gathers(self, i: int) -> bool: ...
    def unused(self, i: int, leaf: jax.Array) -> jax.Array: ...
    def backward(self, b: int, grads: tuple, states: tuple, extras: tuple,
                 step: jax.Array) -> tuple[tuple, tuple, tuple]: ...


def exact_mean(extras: Sequence[jax.Array], after: Sequence[jax.Array], axis_name: Any) -> tuple:
    """The mean of the extras over ``axis_name`` in float32: one all-reduce of their own, chained
    after ``after`` (the bucket's reduced values), for a hook that cannot carry them exactly."""
    if not extras:
        return ()
    dep = chain_dependency(after, "add")
    summed = recorder.psum(tuple(e + dep.astype(e.dtype) for e in extras), axis_name)
    n = axis_size(axis_name)
    return tuple(e / n for e in summed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduce:
    """All-reduce through a hook (stages 0 and 1): every device gets the bucket's mean, whole.

    Attributes:
      hosts_axis: the name in ``axis_name`` that crosses hosts (``HookContext.hosts_axis``).
      phase: the hook's static phase for this step.
    """

    plan: BucketPlan
    hook: CommHook
    axis_name: Any
    hosts_axis: str | None = None
    phase: Any = None
    #: The forward pass moves data (stage 3): the evaluator issues it one bucket ahead.
    prefetch: ClassVar[bool] = False

    def out_struct(self, i: int) -> jax.ShapeDtypeStruct:
        """What the reduction returns for leaf ``i`` (here: the whole mean gradient)."""
        return jax.ShapeDtypeStruct(self.plan.shapes[i], self.plan.dtypes[i])

    def check(self, leaves: Sequence[Any]) -> None:
        self.plan.check_tree(jax.tree.unflatten(self.plan.treedef, list(leaves)))

    def forward(self, b: int, leaves: tuple) -> tuple:
        """The values the loss computes with: cast to varying, the backward reduces them once."""
        del b
        return tuple(vma.to_varying(x, self.axis_name) for x in leaves)

    def gathers(self, i: int) -> bool:
        """Whether the forward pass gathers leaf ``i`` (what a prefetch waits for)."""
        del i
        return False

    def unused(self, i: int, leaf: jax.Array) -> jax.Array:
        """How a leaf in no bucket is read (it gets no gradient)."""
        del i
        return leaf

    def context(self, b: int, step: jax.Array) -> HookContext:
        return HookContext(self.axis_name, axis_size(self.axis_name), step, b, self.phase,
                           *levels(self.axis_name, self.hosts_axis))

    def fuses(self, b: int, extras: Sequence[Any]) -> bool:
        """Whether the extras (float32 loss, metrics, model state) ride on bucket ``b``'s
        collective: only on one that averages float32 exactly, never on a compressed one."""
        del b
        return bool(extras) and bool(getattr(self.hook, "fuses_extras", False))

    def backward(self, b: int, grads: tuple, states: tuple, extras: tuple,
                 step: jax.Array) -> tuple[tuple, tuple, tuple]:
        """``(reduced, new_states, mean_extras)`` from bucket ``b``'s local gradients."""
        hook, n = self.hook, len(grads)
        ctx = self.context(b, step)
        if self.fuses(b, extras):
            both = grads + tuple(extras)
            out = bytemodel.reduce_counted(hook, both, tuple(states) + ((),) * len(extras), ctx)
            both, new_states = check_output(hook, both, out, b)
            reduced, mean_extras, new_states = both[:n], both[n:], new_states[:n]
        else:
            out = bytemodel.reduce_counted(hook, grads, tuple(states), ctx)
            reduced, new_states = check_output(hook, grads, out, b)
            mean_extras = exact_mean(extras, reduced, self.axis_name)
        check_reduced(hook, reduced, self.axis_name, b)
        check_state(hook, tuple(states), new_states, b)
        return reduced, new_states, mean_extras
