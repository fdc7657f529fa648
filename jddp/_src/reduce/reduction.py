"""Bucketed gradient reduction from inside the backward pass.

Each bucket of parameters passes through an identity function with a custom VJP (a "backward hook",
DDP's autograd hook). Its backward rule receives the bucket's local gradients the moment the last of
them is complete and reduces them with one collective, while the backward pass goes on with earlier
layers.

Two details make this hold in compiled XLA:

- Placement. The loss is traced to a jaxpr once (:func:`jddp._src.introspect.jaxpr.trace`); the
  planner reads that jaxpr, and this module evaluates it with each bucket's hook inserted right before the first
  equation that uses any of the bucket's parameters. The transpose of that evaluation then emits
  each bucket's reduction right where its last gradient is produced, instead of after the whole
  backward pass.
- Chaining. XLA's all-reduce combiners merge independent all-reduces (on CPU into a single one after
  the whole backward). Each bucket's gradients therefore take a data dependency on the previous
  bucket's reduced result (see :func:`resolve_chain`); dependent collectives cannot be combined, so
  the plan's bucket boundaries survive compilation without XLA flags.

What a bucket's backward does is a :class:`BucketReducer`: the hook's all-reduce
(:class:`AllReduce`, stages 0-1), a reduce-scatter through the hook with its state
(:class:`ReduceScatter`, stage 2), hybrid sharding (:class:`Hybrid`) and the stage-3 all-gather in
forward (:class:`GatherInForward`); each also says the bytes it sends (:class:`Bytes`, one ring
model). The evaluator (:class:`_Evaluation`) and the one custom VJP (:func:`_bucket_vjp`) know
nothing of stages (docs/design.md, "Reducers").

Gradient semantics under ``shard_map``: with ``check_vma=True`` the gradient of a replicated (``P()``)
parameter would come back already summed by JAX. The hook's forward casts the parameters to
"varying" and its backward performs the only reduction, so the result is one mean in every mode
(``check_vma`` on or off, ``pmap``), never N times it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jddp._src.api import options
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.introspect import vma
from jddp._src.place import zero
from jddp._src.place.zero import Sharded
from jddp._src.plan.planner import BucketPlan, plan_traced
from jddp._src.reduce import replicated
from jddp._src.reduce.collectives import traced_platform, wire_itemsize, wire_nbytes
from jddp._src.reduce.hooks import (
    CommHook,
    HookContext,
    allreduce_mean,
    bucket_bytes_by_level,
    bucket_bytes_sent,
    check_hook,
    gather_invariant,
    hook_name,
    init_hook_state,
    padded_flat,
    unflatten_like,
)
from jddp._src.step.checks import check_float_params, check_scalar_loss
from jddp._src.tree import Bytes, chain_dependency, nbytes, ring
from jddp._src.update import precision as precision_lib


def axis_size(axis_name: Any) -> int:
    """The number of replicas along ``axis_name`` (a static int inside shard_map or pmap)."""
    return int(np.prod([lax.axis_size(a) for a in vma.axis_names(axis_name)]))


def resolve_chain(chain: options.Chain) -> str:
    """The chaining used between buckets; ``"auto"`` is ``"barrier"`` on GPU, ``"add"`` elsewhere.

    Both keep XLA's combiners from merging buckets (measured in docs/xla_flags.md):

    - ``"add"`` adds to each gradient an always-zero scalar that depends on the previous bucket's
      result. On GPU, XLA fuses that add into the weight-gradient GEMMs, which then wait for the
      previous all-reduce instead of overlapping it. On CPU it is the only mode that works (the
      CPU pipeline removes optimization barriers before its combiner runs), and on TPU it gave the
      most backward matmuls after each all-reduce.
    - ``"barrier"`` ties the gradients to the previous bucket's all-reduce outputs with
      ``lax.optimization_barrier``: no arithmetic, so the GEMMs stay free to overlap on GPU.
    - ``"none"`` lets XLA combine the all-reduces as it likes.
    """
    options.chain(chain)
    if chain != "auto":
        return chain
    return "barrier" if _on_gpu() else "add"


def _on_gpu() -> bool:
    """Whether the step is traced for a GPU (the platforms XLA:GPU answers to)."""
    return traced_platform() in ("gpu", "cuda", "rocm")


def backward_prefetch() -> bool:
    """Whether stage 3's backward gathers (``reshard_after_forward``) are prefetched one use
    ahead (see :func:`_regathered`): where collectives are asynchronous (GPU, TPU), not on CPU,
    where a collective cannot overlap anything and a prefetch would only hold gathered leaves
    longer (on the 8-layer test MLP the compiled CPU peak rose from 2.41 to 3.46 MB)."""
    return traced_platform() != "cpu"


def _dep_zeros(chain: str, structs: Sequence[jax.ShapeDtypeStruct], axis_name: Any,
               other: tuple = ()) -> Any:
    """The forward value of a token's dependency part (its cotangent carries the real thing).

    ``"barrier"`` needs the previous bucket's reduced arrays themselves: an optimization barrier
    on a scalar derived from them does not keep XLA's GPU combiner from merging the buckets.
    ``other``: mesh axes the reduced values still vary over (see :func:`bucketed_vjp`).
    """
    if chain == "barrier":
        axes = (*vma.axis_names(axis_name), *other)
        return tuple(vma.to_varying(jnp.zeros(s.shape, s.dtype), axes) for s in structs)
    return _vary(jnp.zeros((), jnp.float32), other)


def _vary(x: Any, axes: tuple) -> Any:
    return vma.to_varying(x, axes) if axes else x


def _float0_like(x: Any) -> Any:
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


_HOOK_SIGNATURE = (
    "reduce(grads: tuple[Array, ...], states: tuple, ctx: HookContext) -> "
    "(mean_grads: tuple[Array, ...], new_states: tuple)"
)


def _check_hook_output(hook: CommHook, grads: Sequence[jax.Array], out: Any, index: int) -> tuple:
    """``(reduced, new_states)`` from what ``hook.reduce`` returned, or a clear error."""
    name = hook_name(hook)
    if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], tuple | list)):
        got = type(out).__name__
        if isinstance(out, tuple | list):
            got += f" of {len(out)} {', '.join(type(x).__name__ for x in out[:3])}..."
        raise TypeError(
            f"Communication hook {name!r} must return a pair (mean_grads, new_states) for bucket "
            f"{index}, got {got}. The expected signature is {_HOOK_SIGNATURE}; a stateless hook "
            "returns its states argument unchanged."
        )
    reduced, new_states = out
    if len(reduced) != len(grads):
        raise ValueError(
            f"Communication hook {name!r} returned {len(reduced)} gradients for bucket {index} of "
            f"{len(grads)} leaves; it must return one reduced gradient per leaf, in order."
        )
    for j, (g, r) in enumerate(zip(grads, reduced, strict=True)):
        if jnp.shape(r) != jnp.shape(g) or jnp.result_type(r) != jnp.result_type(g):
            raise ValueError(
                f"Communication hook {name!r} changed leaf {j} of bucket {index} from "
                f"{jnp.result_type(g)}{list(jnp.shape(g))} to {jnp.result_type(r)}"
                f"{list(jnp.shape(r))}. A hook must return gradients with the shapes and dtypes it "
                "was given (cast back after compressing)."
            )
    return tuple(reduced), tuple(new_states)


def _check_reduced(hook: CommHook, reduced: Sequence[jax.Array], axis_name: Any, index: int):
    """A hook's output must be the same on every replica (reduced), not each device's own."""
    for j, r in enumerate(reduced):
        if any(a in vma.varying_axes(r) for a in vma.axis_names(axis_name)):
            raise ValueError(
                f"Communication hook {hook_name(hook)!r} returned leaf {j} of bucket {index} "
                f"unreduced: it still varies over the data axis {axis_name!r}, so replicas would "
                "apply different updates and drift apart. A hook must reduce (psum/pmean, "
                "all_gather) every gradient. To skip communication on most steps, use local SGD "
                "or DiLoCo (sync=jddp.local_sgd.diloco(...)) instead of a hook, or "
                "accumulate=jddp.Accumulate(steps=k) for gradient accumulation."
            )


def _check_hook_state(hook: CommHook, old: Any, new: Any, index: int) -> None:
    name = hook_name(hook)
    # jaxlib types PyTreeDef loosely for mypy (no __ne__ it can see); the comparison is real.
    if jax.tree.structure(old) != jax.tree.structure(new):  # type: ignore[operator]
        raise ValueError(
            f"Communication hook {name!r} changed the structure of its state for bucket {index}: "
            f"{jax.tree.structure(old)} -> {jax.tree.structure(new)}."
        )
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(
                f"Communication hook {name!r} changed a state leaf of bucket {index} from "
                f"{jnp.result_type(a)}{list(jnp.shape(a))} to {jnp.result_type(b)}"
                f"{list(jnp.shape(b))}; hook state must keep its shapes and dtypes."
            )


# ------------------------------------------------------------------------------------ bytes


def span(axis_name: Any, hosts_axis: str | None) -> tuple[int, int]:
    """``(devices, hosts)`` that a collective over ``axis_name`` spans (inside shard_map)."""
    names = vma.axis_names(axis_name)
    hosts = lax.axis_size(hosts_axis) if hosts_axis is not None and hosts_axis in names else 1
    return axis_size(axis_name), int(hosts)


def hook_bytes(hook: CommHook, leaves: Sequence[Any], axis_name: Any, hosts_axis: str | None,
               step: Any) -> Bytes:
    """Bytes one device sends to reduce ``leaves`` with ``hook`` over ``axis_name``: the hook's
    own accounting (``bytes_sent``, ``bytes_by_level``), or a ring all-reduce."""
    group, hosts = span(axis_name, hosts_axis)
    if 1 < hosts < group:
        inside, across = bucket_bytes_by_level(hook, leaves, hosts, group // hosts, step)
        return Bytes(inside + across, across)
    total = bucket_bytes_sent(hook, leaves, group, step)
    return Bytes(total, total if hosts > 1 else 0.0)


def scatter_bytes(hook: CommHook, rows: jax.ShapeDtypeStruct, axis_name: Any,
                  hosts_axis: str | None, step: Any) -> Bytes:
    """Bytes one device sends in ``hook.scatter`` of the ``(N, K)`` matrix ``rows`` over
    ``axis_name``: the hook's ``scatter_bytes_by_level``, or half its all-reduce accounting."""
    fn = getattr(hook, "scatter_bytes_by_level", None)
    if fn is None:
        return hook_bytes(hook, [rows], axis_name, hosts_axis, step).scaled(0.5)
    group, hosts = span(axis_name, hosts_axis)
    inside, across = fn(rows, hosts, group // hosts, step)
    return Bytes(inside + across, across)


def _f32_structs(structs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(jnp.shape(s), jnp.float32) for s in structs]


# ----------------------------------------------------------------------------- the reducers


def _exact_mean(extras: Sequence[jax.Array], after: Sequence[jax.Array], axis_name: Any) -> tuple:
    """The mean of the extras over ``axis_name`` in float32: one all-reduce of their own, chained
    after ``after`` (the bucket's reduced values), for a hook that cannot carry them exactly."""
    if not extras:
        return ()
    dep = chain_dependency(after, "add")
    summed = lax.psum(tuple(e + dep.astype(e.dtype) for e in extras), axis_name)
    n = axis_size(axis_name)
    return tuple(e / n for e in summed)


class BucketReducer(Protocol):
    """How a bucket's parameters reach the loss (``forward``) and how its gradients are reduced
    (``backward``), and the bytes that costs (``bytes``). :func:`bucketed_vjp` puts one custom
    VJP per bucket around any reducer; see docs/design.md, "Adding a reducer"."""

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
    def bytes(self, b: int, extras: Sequence[Any], step: Any) -> Bytes: ...
    def mean_bytes(self, extras: Sequence[Any]) -> Bytes: ...
    def unused_bytes(self) -> Bytes: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllReduce:
    """All-reduce through a hook (stages 0 and 1): every device gets the bucket's mean, whole.

    Attributes:
      plan: the bucket plan.
      hook: the communication hook (``hook.reduce`` with the bucket's hook state).
      axis_name: the axes the mean is over.
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
                           *_levels(self.axis_name, self.hosts_axis))

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
            out = hook.reduce(both, tuple(states) + ((),) * len(extras), ctx)
            both, new_states = _check_hook_output(hook, both, out, b)
            reduced, mean_extras, new_states = both[:n], both[n:], new_states[:n]
        else:
            out = hook.reduce(grads, tuple(states), ctx)
            reduced, new_states = _check_hook_output(hook, grads, out, b)
            mean_extras = _exact_mean(extras, reduced, self.axis_name)
        _check_reduced(hook, reduced, self.axis_name, b)
        _check_hook_state(hook, tuple(states), new_states, b)
        return reduced, new_states, mean_extras

    def bytes(self, b: int, extras: Sequence[Any], step: Any) -> Bytes:
        """Bytes one device sends to reduce bucket ``b`` (and the extras, on the last)."""
        leaves = self.plan.leaf_structs(b)
        if self.fuses(b, extras):
            return hook_bytes(self.hook, [*leaves, *_f32_structs(extras)], self.axis_name,
                              self.hosts_axis, step)
        return (hook_bytes(self.hook, leaves, self.axis_name, self.hosts_axis, step)
                + self.mean_bytes(extras))

    def mean_bytes(self, extras: Sequence[Any]) -> Bytes:
        """Bytes of :func:`_exact_mean` of ``extras``."""
        if not extras:
            return Bytes()
        group, hosts = span(self.axis_name, self.hosts_axis)
        return ring("all-reduce", sum(nbytes(e) for e in _f32_structs(extras)), group, hosts)

    def unused_bytes(self) -> Bytes:
        return Bytes()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReduceScatter(AllReduce):
    """Reduce-scatter through a hook (stage 2): each device keeps the mean of its piece of every
    leaf (a leaf kept whole, whole; see :mod:`jddp._src.place.zero`).

    With ``scatters`` (a stateless hook with ``CommHook.scatter``) the bucket is one
    reduce-scatter of an ``(N, K)`` matrix. Otherwise (PowerSGD, error feedback, hierarchical)
    the hook reduces the bucket with its state exactly as at stage 0 and each device keeps its
    piece of the mean: the same numbers as stage 0, at the hook's bytes.

    Attributes:
      layout: how every leaf is split.
      shard_axis: the axis the pieces are split over.
      scatters: reduce-scatter through ``hook.scatter`` (else ``hook.reduce``, then the piece).
    """

    layout: zero.Layout
    shard_axis: Any
    scatters: bool = True

    def out_struct(self, i: int) -> jax.ShapeDtypeStruct:
        lay = self.layout
        return jax.ShapeDtypeStruct(zero.shard_shape(self.plan.shapes[i], lay.dims[i], lay.n),
                                    self.plan.dtypes[i])

    def forward(self, b: int, leaves: tuple) -> tuple:
        del b
        return tuple(leaves)

    def dims(self, b: int) -> tuple[int | None, ...]:
        return tuple(self.layout.dims[i] for i in self.plan.buckets[b].indices)

    def fuses(self, b: int, extras: Sequence[Any]) -> bool:
        # On the reduce-scatter the extras are whole rows of the bucket's one float32 matrix.
        return super().fuses(b, extras) and (not self.scatters or all(
            self.plan.dtypes[i] == np.float32 for i in self.plan.buckets[b].indices))

    def scatter_context(self, b: int, step: jax.Array) -> HookContext:
        return HookContext(self.axis_name, self.layout.n, step, b, self.phase,
                           *_levels(self.axis_name, self.hosts_axis))

    def scatter(self, rows: jax.Array, ctx: HookContext) -> jax.Array:
        """This device's mean row of an ``(N, K)`` matrix."""
        return self.hook.scatter(rows, ctx)  # type: ignore[misc]  # scatters: it has one

    def backward(self, b: int, grads: tuple, states: tuple, extras: tuple,
                 step: jax.Array) -> tuple[tuple, tuple, tuple]:
        dims, n = self.dims(b), self.layout.n
        if not self.scatters:
            reduced, new_states, mean_extras = super().backward(b, grads, states, extras, step)
            index = lax.axis_index(self.shard_axis)
            pieces = tuple(zero.local_piece(r, d, n, index)
                           for r, d in zip(reduced, dims, strict=True))
            return pieces, new_states, mean_extras
        ctx = self.scatter_context(b, step)

        def scatter(rows: jax.Array) -> jax.Array:
            return self.scatter(rows, ctx)

        if self.fuses(b, extras):
            out = zero.reduce_scatter(grads + tuple(extras), dims + (None,) * len(extras), n,
                                      self.shard_axis, scatter)
            return tuple(out[: len(grads)]), tuple(states), tuple(out[len(grads):])
        pieces = tuple(zero.reduce_scatter(grads, dims, n, self.shard_axis, scatter))
        return pieces, tuple(states), _exact_mean(extras, pieces, self.axis_name)

    def bytes(self, b: int, extras: Sequence[Any], step: Any) -> Bytes:
        if not self.scatters:
            return super().bytes(b, extras, step)
        fused = self.fuses(b, extras)
        idx = self.plan.buckets[b].indices
        width = sum(math.prod(self.out_struct(i).shape) for i in idx)
        if fused:
            width += sum(math.prod(jnp.shape(e)) for e in extras)
        dtype = jnp.result_type(*(self.plan.dtypes[i] for i in idx))
        rows = jax.ShapeDtypeStruct((self.layout.n, width), dtype)
        sent = self.scatter_bytes(rows, step)
        return sent if fused else sent + self.mean_bytes(extras)

    def scatter_bytes(self, rows: jax.ShapeDtypeStruct, step: Any) -> Bytes:
        """Bytes of :meth:`scatter`: the hook's ``scatter_bytes_by_level``, or, as a ring
        reduce-scatter sends half what a ring all-reduce of the same rows does, half the hook's
        own accounting of that all-reduce."""
        return scatter_bytes(self.hook, rows, self.shard_axis, self.hosts_axis, step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hybrid(ReduceScatter):
    """Hybrid sharding (FSDP's ``HYBRID_SHARD``): the hook reduce-scatters each bucket inside the
    host (``shard_axis``) and each device's piece is averaged across hosts (``replicas``), so the
    slow link carries ``1/L`` of the bucket. A hook without a scatter reduces over every data
    axis with its state, as in :class:`ReduceScatter`.

    Attributes:
      replicas: the axis across which the pieces are replicated (the hosts).
    """

    replicas: str

    def scatter_context(self, b: int, step: jax.Array) -> HookContext:
        return HookContext(self.shard_axis, self.layout.n, step, b, self.phase, None,
                           self.shard_axis)

    def scatter(self, rows: jax.Array, ctx: HookContext) -> jax.Array:
        return lax.pmean(super().scatter(rows, ctx), self.replicas)

    def scatter_bytes(self, rows: jax.ShapeDtypeStruct, step: Any) -> Bytes:
        inside = scatter_bytes(self.hook, rows, self.shard_axis, None, step)
        hosts = int(lax.axis_size(self.replicas))
        row = rows.shape[1] * wire_itemsize(rows.dtype)
        return inside + ring("all-reduce", row, hosts, hosts)


@dataclasses.dataclass(frozen=True)
class GatherInForward:
    """Stage 3: the parameters come in as this device's pieces; the forward pass all-gathers each
    bucket before its first use (issued one bucket ahead, as a prefetch) and the backward pass
    reduces like ``inner``.

    Attributes:
      inner: the backward's reducer (:class:`ReduceScatter` or :class:`Hybrid`).
      reshard: FSDP's ``reshard_after_forward``: every equation that reads a gathered leaf, or
        a value computed from leaves alone (a cast, a transpose: recomputed inside it, see
        :func:`jddp._src.introspect.jaxpr.eval_with_hooks`), runs through :func:`_regathered`,
        which keeps only the pieces for its backward and gathers the leaf again there, so a gathered bucket
        lives from its gather to its last forward use, and again around each backward use.
        ``False``: a gathered bucket stays whole until the backward is done with it (the
        user's operations keep it as a residual).
      dtype: the dtype the loss computes with (a mixed-precision policy's ``param_dtype``):
        pieces are cast to it before they are gathered (forward and backward gathers), leaves
        kept whole are cast too; ``None``: their own.
      group: with ``reshard``, ZeRO++'s hpZ (an int ``reshard_after_forward``): the backward
        gathers from a secondary copy, this device's ``1/group`` slice of the forward's gathered
        leaf, over its group of ``group`` consecutive devices only (inside a host on a two-level
        mesh); ``None``: from the step's pieces, over the whole shard axis.
    """

    inner: ReduceScatter
    reshard: bool = False
    dtype: Any = None
    group: int | None = None
    prefetch: ClassVar[bool] = True

    @property
    def axis_name(self) -> Any:
        return self.inner.axis_name

    def out_struct(self, i: int) -> jax.ShapeDtypeStruct:
        return self.inner.out_struct(i)

    def check(self, leaves: Sequence[Any]) -> None:
        del leaves  # pieces: their shapes were checked against the layout by the caller

    def gathers(self, i: int) -> bool:
        return self.inner.layout.dims[i] is not None

    def _gather(self, indices: Sequence[int], pieces: Sequence[jax.Array]) -> list[jax.Array]:
        lay, plan = self.inner.layout, self.inner.plan
        split = [j for j, i in enumerate(indices) if lay.dims[i] is not None]
        out = list(pieces) if self.dtype is None else [p.astype(self.dtype) for p in pieces]
        if not split:
            return out
        full = zero.all_gather([out[j] for j in split],
                               [lay.dims[indices[j]] for j in split],  # type: ignore[misc]
                               [plan.shapes[indices[j]] for j in split], self.inner.shard_axis)
        for j, f in zip(split, full, strict=True):
            out[j] = f
        return out

    def forward(self, b: int, leaves: tuple) -> tuple:
        return tuple(self._gather(self.inner.plan.buckets[b].indices, leaves))

    def keep(self, indices: Sequence[int], out: list, pieces: Sequence[jax.Array],
             full: Sequence[jax.Array]) -> tuple[list, tuple]:
        """``(out, kept)``: what the forward keeps of the gathered leaves ``indices`` (read by an
        equation with outputs ``out``) for their backward gather: this device's ``pieces``, or
        with ``group`` its slice of each gathered leaf ``full``, computed in the forward."""
        if self.group is None:
            return out, tuple(pieces)
        dims = self.inner.layout.dims  # the gathered leaves are split ones (not None)
        kept = tuple(zero.subgroup_piece(f, dims[i], self.group,  # type: ignore[arg-type]
                                         self.inner.shard_axis)
                     for i, f in zip(indices, full, strict=True))
        return _in_forward(out, kept, self.inner.shard_axis)

    def regather(self, indices: Sequence[int], kept: Sequence[jax.Array]) -> list[jax.Array]:
        """The whole leaves ``indices`` from what :meth:`keep` kept (a backward gather)."""
        if self.group is None or not indices:
            return self._gather(indices, kept)
        plan, dims = self.inner.plan, self.inner.layout.dims
        return zero.all_gather(kept, [dims[i] for i in indices],  # type: ignore[misc]
                               [plan.shapes[i] for i in indices], self.inner.shard_axis,
                               self.group)

    def regather_bytes(self, indices: Sequence[int]) -> Bytes:
        """Bytes of :meth:`regather`: with ``group``, a ring all-gather of ``n / group`` pieces
        per device over ``group`` devices of one host (nothing crosses hosts)."""
        if self.group is None:
            return self.gather_bytes(indices)
        inner = self.inner
        dtypes = inner.plan.dtypes if self.dtype is None else [self.dtype] * len(inner.plan.dtypes)
        piece = zero.split_bytes(inner.layout, dtypes, indices)
        return ring("all-gather", piece * inner.layout.n // self.group, self.group)

    def unused(self, i: int, leaf: jax.Array) -> jax.Array:
        return self._gather((i,), (leaf,))[0]

    def backward(self, b: int, grads: tuple, states: tuple, extras: tuple,
                 step: jax.Array) -> tuple[tuple, tuple, tuple]:
        return self.inner.backward(b, grads, states, extras, step)

    def gather_bytes(self, indices: Sequence[int]) -> Bytes:
        inner = self.inner
        group, hosts = span(inner.shard_axis, inner.hosts_axis)
        dtypes = inner.plan.dtypes if self.dtype is None else [self.dtype] * len(inner.plan.dtypes)
        return ring("all-gather", zero.split_bytes(inner.layout, dtypes, indices), group, hosts)

    def bytes(self, b: int, extras: Sequence[Any], step: Any) -> Bytes:
        return (self.inner.bytes(b, extras, step)
                + self.gather_bytes(self.inner.plan.buckets[b].indices))

    def mean_bytes(self, extras: Sequence[Any]) -> Bytes:
        return self.inner.mean_bytes(extras)

    def unused_bytes(self) -> Bytes:
        return self.gather_bytes(self.inner.plan.unused)


def make_reducer(plan: BucketPlan, hook: CommHook, axis_name: Any, *,
                 sharded: Sharded | None = None, hosts_axis: str | None = None,
                 phase: Any = None, stateful: bool = False,
                 precision: precision_lib.MixedPrecision | None = None) -> BucketReducer:
    """The reducer of a step: the hook's all-reduce, or a sharded stage's (hybrid)
    reduce-scatter, with the stage-3 all-gather in forward; under a mixed-precision policy, its
    :class:`jddp._src.update.precision.Cast`.

    Args:
      stateful: the hook keeps state for some leaf (it cannot reduce through ``scatter``).
    """
    if sharded is None:
        return precision_lib.wrap_reducer(AllReduce(
            plan=plan, hook=hook, axis_name=axis_name, hosts_axis=hosts_axis, phase=phase),
            precision)
    common: dict[str, Any] = dict(
        plan=plan, hook=hook, axis_name=axis_name, hosts_axis=hosts_axis, phase=phase,
        layout=sharded.layout, shard_axis=axis_name if sharded.axis is None else sharded.axis,
        scatters=getattr(hook, "scatter", None) is not None and not stateful,
    )
    inner = (ReduceScatter(**common) if sharded.replicas is None
             else Hybrid(**common, replicas=sharded.replicas))
    if sharded.gathers:  # casts to a policy's param_dtype itself, before its gathers
        return GatherInForward(inner, sharded.reshard, precision_lib.gather_dtype(precision),
                               sharded.group)
    return precision_lib.wrap_reducer(inner, precision)


# ------------------------------------------------------------------- one VJP, one evaluator


class _Slot(NamedTuple):
    """A bucket's place in the chain, all static."""

    bucket: int
    last: bool
    chain: str
    prev_structs: tuple[jax.ShapeDtypeStruct, ...]  # what the previous bucket's reduction gives
    other_axes: tuple = ()


def _zeros(x: Any) -> jax.Array:
    """Zeros shaped, typed and varying like ``x``."""
    return vma.to_varying(jnp.zeros(jnp.shape(x), jnp.result_type(x)),
                          tuple(sorted(vma.varying_axes(x))))


def _local_grads(ct_leaves: tuple, offset: Any, ct_dep: Any, chain: str) -> tuple:
    """The bucket's local gradients: this micro-batch's, plus the offset, chained on the
    previous bucket (see the module docstring)."""
    grads = tuple(ct_leaves)
    if offset:
        grads = tuple(g + o.astype(g.dtype) for g, o in zip(grads, offset, strict=True))
    # JAX emits one collective per leaf and XLA's combiner merges independent ones, so every
    # leaf needs the dependency: a scalar carried alongside would not keep the leaves apart.
    if chain == "add":
        grads = tuple(g + ct_dep.astype(g.dtype) for g in grads)
    elif chain == "barrier" and ct_dep:
        grads, _ = lax.optimization_barrier((grads, ct_dep))
    return grads


def _dep_cotangent(dep: Any, token_dep: Any, chain: str, axis_name: Any) -> Any:
    """The token's cotangent: what the next bucket in backward order waits for."""
    if chain == "barrier":
        return tuple(vma.to_varying(r, axis_name) for r in dep)
    return vma.like(dep.astype(jnp.result_type(token_dep)), token_dep, axis_name)


def _in_bucket_scope(fn: Callable[..., Any], bucket: int) -> Callable[..., Any]:
    """``fn`` under ``jax.named_scope`` of the bucket: its collectives carry the bucket's name in
    the compiled program's ``op_name`` (``ddp.report``, the program check, profiler traces)."""
    from jddp._src.introspect import hlo  # the name's one definition; loaded at trace time

    name = hlo.bucket_scope(bucket)

    @functools.wraps(fn)
    def scoped(*args: Any) -> Any:
        with jax.named_scope(name):
            return fn(*args)

    return scoped


def _bucket_vjp(reducer: BucketReducer, slot: _Slot) -> Callable[..., Any]:
    """The identity-with-reducing-VJP of one bucket (DDP's autograd hook), for any reducer.

    Arguments: ``(token, leaves, states, carry, offset, step, sink)``; the forward returns
    ``(token, reducer.forward(leaves))``. A custom VJP can return values only as cotangents:

    - ``token = (dep, extras)``: in backward, ``dep`` carries the dependency on the previous
      bucket and ``extras`` the local values (metrics) averaged with the last bucket;
    - ``states``: the hook state of each leaf; its cotangent is the new state;
    - ``carry``: zeros shaped like the reduction's result; its cotangent is the reduced
      gradient (whole, or this device's pieces), so the parameters' own cotangent is unused;
    - ``offset``: local gradients added before the reduction (accumulated micro-batches);
    - ``sink``: zeros shaped like the extras; on the last bucket its cotangent is their mean.
    """
    axis_name, chain = reducer.axis_name, slot.chain

    @jax.custom_vjp
    def ident(token, leaves, states, carry, offset, step, sink):
        del states, carry, offset, step, sink
        token_out = (_dep_zeros(chain, slot.prev_structs, axis_name, slot.other_axes), token[1])
        return token_out, reducer.forward(slot.bucket, tuple(leaves))

    def fwd(token, leaves, states, carry, offset, step, sink):
        # The primal leaves and carry are residuals only for their types (no copy: the leaves
        # are the parameters, alive anyway; the carry is zeros XLA never materialises).
        out = ident(token, leaves, states, carry, offset, step, sink)
        return out, (leaves, states, carry, offset, step, token, sink)

    def bwd(res, cts):
        leaves, states, carry, offset, step, token, sink = res
        (ct_dep, ct_extras), ct_leaves = cts
        # Local gradients are summed and reduced in the dtype of the reduction's result (the
        # parameters' own; under a mixed-precision policy the loss computed in another).
        ct_leaves = tuple(g.astype(c.dtype) for g, c in zip(ct_leaves, carry, strict=True))
        grads = _local_grads(ct_leaves, offset, ct_dep, chain)
        extras = tuple(ct_extras) if slot.last else ()
        reduced, new_states, mean_extras = reducer.backward(slot.bucket, grads, tuple(states),
                                                            extras, step)
        dep = chain_dependency(reduced, chain)  # before the casts: the token is replicated
        like = lambda x, old: vma.like(x, old, axis_name)  # noqa: E731
        ct_carry = tuple(like(r, c) for r, c in zip(reduced, carry, strict=True))
        new_states = jax.tree.map(like, tuple(new_states), tuple(states))
        mean_extras = tuple(like(e, s) for e, s in zip(
            mean_extras or tuple(_zeros(s) for s in sink), sink, strict=True))
        ct_token = (_dep_cotangent(dep, token[0], chain, axis_name),
                    tuple(_zeros(e) for e in ct_extras) if slot.last else tuple(ct_extras))
        return (ct_token, tuple(_zeros(x) for x in leaves), new_states, ct_carry,
                jax.tree.map(_zeros, offset), _float0_like(step), mean_extras)

    # The forward's collectives (stage 3's all-gathers) belong to the bucket too.
    ident.defvjp(_in_bucket_scope(fwd, slot.bucket) if reducer.prefetch else fwd,
                 _in_bucket_scope(bwd, slot.bucket))
    return ident


def _token_cotangent(dep: Any, token: Any) -> Any:
    """``dep`` (an always-zero scalar) as the cotangent of ``token``: typed and varying like it;
    ``None`` (no prefetch through this link) when ``dep`` varies over axes ``token`` does not."""
    axes = vma.varying_axes(token)
    if token is None or dep is None or not vma.varying_axes(dep) <= axes:
        return None
    return vma.to_varying(dep.astype(token.dtype), tuple(sorted(axes)))


def _regathered(eqn: Any, invals: list, sources: tuple, leaves: dict[int, Any],
                pieces: dict[int, jax.Array], reducer: GatherInForward,
                record: Callable[[Sequence[int]], None], token: Any) -> tuple[list, Any]:
    """Evaluates ``eqn`` on its gathered parameter inputs, keeping only their pieces (hpZ: see
    :meth:`GatherInForward.keep`) for the backward, which gathers them again; returns its
    outputs and the token for the next such equation.

    A custom VJP whose residuals are the equation's other inputs and the pieces: the gathered
    leaves it read are not kept. Its backward gathers only the leaves the equation's VJP needs
    for the inputs that need a cotangent (an addition's VJP needs no operand; a first layer's
    weight gradient needs only its input), then recomputes the equation's VJP on them (XLA
    drops the recomputed forward output when the VJP does not need it, as for a matmul's).

    With a ``token`` (GPU, TPU: :func:`backward_prefetch`) the gather is prefetched one use
    ahead (FSDP's ``BACKWARD_PRE``): ``token`` is the previous such equation's token output (a
    zero scalar), whose cotangent this backward returns: an always-zero scalar depending on
    this equation's output cotangent and gathered leaves. A gather waits for its token's
    cotangent: for the next parameter-reading equation's backward to start and for its gather
    (so XLA cannot combine the two), and runs while that equation's GEMMs compute; an equation
    that gathers nothing passes the cotangent on. The last one (the first in backward), and all
    without a token (CPU), wait for their own output cotangent. Either way the gather waits for
    the backward pass, so XLA's CSE cannot merge it with the forward's (the leaf stays whole).

    An input computed from parameters alone (a cast to bfloat16, a transpose: a
    :class:`jddp._src.introspect.jaxpr.Derived` source) is recomputed from the gathered leaves, in
    the forward and again in the backward, so that neither it nor its leaves are kept whole.

    Args:
      sources: per input of ``eqn``, the parameter leaf it reads, the value computed from
        leaves alone that it reads, or ``None`` (its value in ``invals``).
      leaves: the value of every leaf ``sources`` read (gathered ones whole).
      pieces: per gathered leaf index, this device's piece (the step's input).
      record: told the leaves the backward gathers (for ``comm_bytes``), when it is traced.
      token: the previous such equation's token output, or the first token (a zero scalar);
        ``None``: no prefetch (the gather waits for this equation's own output cotangent).
    """
    idx, whole, other_pos = _regathered_inputs(invals, sources, leaves, pieces)
    perturbed: list[bool] = []

    def run(others: tuple, full: tuple) -> list:
        vals = list(invals)
        for j, x in zip(other_pos, others, strict=True):
            vals[j] = x
        values = dict(zip(whole, others[len(other_pos):], strict=True))
        values.update(zip(idx, full, strict=True))
        return jaxpr_lib.bind_eqn(eqn, jaxpr_lib.fill(vals, sources, values))

    @jax.custom_vjp
    def op(others: tuple, full: tuple, pcs: tuple, tok: Any) -> tuple[list, Any]:
        del pcs
        return run(others, full), tok

    def fwd(others: tuple, full: tuple, pcs: tuple, tok: Any) -> tuple:
        perturbed[:] = [o.perturbed for o in others] + [tok is not None and tok.perturbed]
        values, fulls = tuple(o.value for o in others), tuple(f.value for f in full)
        tok = None if tok is None else tok.value
        out, kept = reducer.keep(idx, run(values, fulls), [p.value for p in pcs], fulls)
        return (out, tok), (values, kept, tok)

    def bwd(res: tuple, cts: tuple) -> tuple:
        others, pcs, tok = res
        out_cts, ahead = cts
        out_cts = [jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c
                   for c in out_cts]
        floats = [c for c in out_cts if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
        own = chain_dependency(floats, "add") if floats else None
        ahead = own if ahead is None or isinstance(ahead, SymbolicZero) else ahead
        d_others, d_full, gathered, after = _regathered_vjp(
            run, others, out_cts, [k for k, p in enumerate(perturbed[:-1]) if p],
            idx, pcs, reducer, ahead, tok is not None)
        record(gathered)
        passed = _passed_on(ahead, own, after, gathered)
        return (d_others, d_full, tuple(None for _ in pcs),
                _token_cotangent(passed, tok) if perturbed[-1] else None)

    op.defvjp(fwd, bwd, symbolic_zeros=True)
    outs, token_out = op((*(invals[j] for j in other_pos), *(leaves[i] for i in whole)),
                         tuple(leaves[i] for i in idx), tuple(pieces[i] for i in idx), token)
    return outs, token_out


def _regathered_inputs(invals: list, sources: tuple, leaves: dict[int, Any],
                       pieces: dict[int, jax.Array]) -> tuple[tuple, tuple, list[int]]:
    """The gathered leaves read, the leaves read whole (not gathered, read as they come) and
    the positions of the equation's other (non-parameter) array inputs."""
    idx = tuple(i for i in leaves if i in pieces)
    whole = tuple(i for i in leaves if i not in pieces)
    other_pos = [j for j, (x, s) in enumerate(zip(invals, sources, strict=True))
                 if s is None and isinstance(x, jax.Array | jax.core.Tracer)]
    return idx, whole, other_pos


def _passed_on(ahead: Any, own: Any, after: Any, gathered: Any) -> Any:
    """What the previous equation's gather waits for: this one's backward start and its gather
    (so that XLA's combiner cannot merge the two); else what this one got."""
    if not gathered:
        return ahead
    return own if after is None else (after if own is None else own + after)


def _regathered_vjp(run: Callable[[tuple, tuple], list], others: tuple, cts: list,
                    diff: list[int], idx: tuple, pcs: tuple, reducer: GatherInForward,
                    wait: Any, prefetch: bool) -> tuple[tuple, tuple, list[int], Any]:
    """The backward of :func:`_regathered`: gathers the leaves ``idx`` its VJP reads (once
    ``wait`` is there) and differentiates ``run`` at them; ``(d_others, d_full, gathered,
    after)``, ``after`` (with ``prefetch``) an always-zero scalar that depends on the gathered
    leaves, else ``None``."""

    def grads(full: tuple) -> tuple:
        def f(d_others: tuple, full: tuple) -> list:
            vals = list(others)
            for k, x in zip(diff, d_others, strict=True):
                vals[k] = x
            return run(tuple(vals), full)
        _, vjp = jax.vjp(f, tuple(others[k] for k in diff), full)
        return vjp(list(cts))

    # The leaves as the equation reads them: in a mixed-precision policy's dtype if any.
    structs = tuple(jax.ShapeDtypeStruct(zero_shape, dtype) for zero_shape, dtype in
                    ((reducer.inner.plan.shapes[i], reducer.inner.plan.dtypes[i]
                      if reducer.dtype is None else reducer.dtype) for i in idx))
    needed = jaxpr_lib.used_inputs(jax.make_jaxpr(grads)(structs))
    need = [k for k in range(len(idx)) if needed[k]]
    if need and wait is not None:
        dep = lax.stop_gradient(wait)
        pcs = tuple(p + dep.astype(p.dtype) for p in pcs)
    # Under its bucket's name, as the forward's gather: the report and profiles file it there.
    # (Leaves of several buckets read by one equation are gathered in one collective: the first
    # bucket's name.)
    from jddp._src.introspect import hlo  # the name's one definition; loaded at trace time

    buckets = [b for b, bucket in enumerate(reducer.inner.plan.buckets)
               if any(idx[k] in bucket.indices for k in need)]
    with jax.named_scope(hlo.bucket_scope(buckets[0])) if buckets else contextlib.nullcontext():
        got = reducer.regather([idx[k] for k in need], [pcs[k] for k in need])
    full = [jnp.zeros(s.shape, s.dtype) for s in structs]
    for k, x in zip(need, got, strict=True):
        full[k] = x
    d_diff, d_full = grads(tuple(full))
    after = None
    if got and prefetch:
        # The leaves' gradients (hence their bucket's reduction and the optimizer's update of
        # their pieces) wait for the gather: else XLA:GPU fuses the update and the add above
        # into one multi-output fusion, and the gather waits for the bucket's reduction.
        after = lax.stop_gradient(chain_dependency(got, "add"))
        d_full = tuple(d + after.astype(d.dtype) for d in d_full)
    d_others: list[Any] = [None] * len(others)
    for k, d in zip(diff, d_diff, strict=True):
        d_others[k] = d
    return tuple(d_others), tuple(d_full), [idx[k] for k in need], after


def _in_forward(out: list, kept: tuple, axis: Any) -> tuple[list, tuple]:
    """``(out, kept)``, with ``kept`` (hpZ's secondary copy: slices of the forward's gathered
    leaves) computed in the forward pass, before ``out`` is used: otherwise XLA fuses the slices
    into the backward gather's operand, which then reads the gathered leaves, and they stay whole
    until the backward. On GPU an optimization barrier says so (checked on the compiled H100
    step; a conditional there would read its predicate on the host). XLA:CPU drops barriers
    before scheduling, so elsewhere ``kept`` comes out of a conditional (which XLA neither fuses
    nor sees through; its predicate is always true but not a constant) and ``out`` takes an
    always-zero dependency on it (tests/test_hpz.py checks both peaks)."""
    if _on_gpu():
        return lax.optimization_barrier((out, kept))
    kept = lax.cond(lax.axis_index(axis) >= 0, lambda k: tuple(k),
                    lambda k: tuple(jnp.zeros_like(x) for x in k), kept)
    dep = chain_dependency(kept, "add")
    return [o + dep.astype(o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact) else o
            for o in out], kept


class _Evaluation:
    """The traced loss evaluated with each bucket's VJP inserted right before the first equation
    that reads one of its parameters; buckets whose parameters no equation reads still reduce,
    once. With a ``prefetch`` reducer (stage 3) bucket ``b - 1``'s forward is issued at bucket
    ``b``'s first use, waiting for the previous gather and for that layer's inputs, so that it
    runs while the layer computes. Knows nothing of stages: only the reducer's answers."""

    def __init__(self, traced: jaxpr_lib.Traced, plan: BucketPlan, reducer: BucketReducer,
                 vjps: Sequence[Callable[..., Any]], args: Sequence[Any], offset: Any,
                 step: jax.Array, chain: str):
        self.traced, self.plan, self.reducer, self.vjps = traced, plan, reducer, vjps
        self.args, self.offset, self.step, self.chain = args, offset, step, chain
        self.owner = {i: b for b, bucket in enumerate(plan.buckets) for i in bucket.indices}

    def __call__(self, leaves, states, carry, token0, sink):
        self.inputs, self.token, self.sink = (leaves, states, carry), token0, sink
        self.hooked: dict[int, Any] = {}
        self.gathered: list = []  # the last bucket's gathered leaves, which the next waits for
        self.used: set[int] = set()  # buckets whose parameters an equation has read
        for i in self.plan.unused:
            # Unused leaves get a zero gradient, identical on every replica: nothing to reduce.
            # They may still be read (aux outputs, integer paths): varying like the traced
            # params, behind stop_gradient so that no implicit reduction is transposed.
            leaf = self.reducer.unused(i, lax.stop_gradient(leaves[i]))
            self.hooked[i] = vma.to_varying(leaf, self.reducer.axis_name)
        # Leaves JAX reduces itself are read replicated (see jddp._src.reduce.replicated).
        self.casts = replicated.LateCasts(self.traced) if self.plan.implicit else None
        for i in self.plan.implicit:
            assert self.casts is not None and not vma.varying_axes(leaves[i])
            self.hooked[i] = self.casts.replicated(leaves[i])
        bind = self.bind if getattr(self.reducer, "reshard", False) else None
        self.regathers: list[int] = []  # leaves gathered again in backward, once per use
        # The backward prefetch's token, passed from one parameter-reading equation to the next
        # (see _regathered): varying over every axis an input varies over.
        axes = frozenset().union(*(vma.varying_axes(x) for x in jax.tree.leaves(
            (tuple(leaves), tuple(self.args)))))
        self.prefetch_token = (_vary(jnp.zeros((), jnp.float32), tuple(sorted(axes)))
                               if bind is not None and backward_prefetch() else None)
        out = jaxpr_lib.eval_with_hooks(self.traced, leaves, self.args, self.read, bind,
                                        self.casts)
        for b in range(self.plan.num_buckets):
            if self.plan.buckets[b].indices[0] not in self.hooked:
                self.apply(b)
        return (jax.tree.leaves(out)[0], self.token), out

    def apply(self, b: int, context: tuple = ()) -> None:
        leaves, states, carry = self.inputs
        idx = self.plan.buckets[b].indices
        leaves_b = tuple(leaves[i] for i in idx)
        if self.reducer.prefetch and self.chain != "none":
            # Wait for the previous gather (so XLA's all-gather combiner cannot merge them) and
            # for the inputs of the layer before the first use (so the gather is a prefetch).
            waits = [*self.gathered, *(c for c in context if hasattr(c, "dtype")
                                       and jnp.issubdtype(c.dtype, jnp.inexact))]
            if waits:
                dep = lax.stop_gradient(chain_dependency(waits, "add"))
                leaves_b = tuple(x + dep.astype(x.dtype) for x in leaves_b)
        last = b == self.plan.num_buckets - 1
        self.token, out = self.vjps[b](
            self.token, leaves_b, tuple(states[i] for i in idx), tuple(carry[i] for i in idx),
            tuple(self.offset[i] for i in idx) if self.offset is not None else (), self.step,
            self.sink if last else tuple(jnp.zeros_like(s) for s in self.sink),
        )
        if self.reducer.prefetch:
            self.gathered = [o for o, i in zip(out, idx, strict=True) if self.reducer.gathers(i)]
        self.hooked.update(zip(idx, out, strict=True))

    def bind(self, eqn: Any, invals: list, sources: tuple, full: dict) -> list:
        """An equation that reads parameters, directly or through values computed from them
        alone (``reshard_after_forward``: see _regathered)."""
        reducer = self.reducer
        assert isinstance(reducer, GatherInForward)
        pieces = {i: self.inputs[0][i] for i in full
                  if i not in self.plan.unused and reducer.gathers(i)}
        if not pieces:
            return jaxpr_lib.bind_eqn(eqn, jaxpr_lib.fill(invals, sources, full))
        outs, self.prefetch_token = _regathered(eqn, invals, sources, full, pieces, reducer,
                                                self.regathers.extend, self.prefetch_token)
        return outs

    def read(self, i: int, context: tuple = ()) -> Any:
        if i not in self.hooked:
            self.apply(self.owner[i], context)
        b = self.owner.get(i)
        if self.reducer.prefetch and b is not None and b not in self.used:
            self.used.add(b)
            if b > 0 and self.plan.buckets[b - 1].indices[0] not in self.hooked:
                # Prefetch the bucket used next (buckets are in reverse first-use order).
                self.apply(b - 1, context)
        return self.hooked[i]


class Reduced(NamedTuple):
    """What :func:`bucketed_vjp` returns.

    Attributes:
      out: the traced function's output on this device (local values).
      grads: gradient leaves (``jax.tree.leaves`` order), reduced over the axis (at the sharded
        stages this device's pieces); unused leaves get zeros.
      hook_state: the hook's new per-leaf state.
      extras: the extras averaged over the axis (structure of ``extras_shape``).
      sent: the bytes the reducers sent for it (gradients, extras, stage 3's forward gathers).
    """

    out: Any
    grads: list[Any]
    hook_state: tuple
    extras: Any
    sent: Bytes = Bytes()


def _levels(axis_name: Any, hosts_axis: str | None) -> tuple[str | None, Any]:
    """``(hosts, local)`` of a reduction over ``axis_name`` for :class:`HookContext`."""
    names = vma.axis_names(axis_name)
    if hosts_axis is None or hosts_axis not in names or len(names) < 2:
        return None, axis_name
    local = tuple(a for a in names if a != hosts_axis)
    return hosts_axis, local[0] if len(local) == 1 else local


def bucketed_vjp(
    traced: jaxpr_lib.Traced,
    param_leaves: Sequence[jax.Array],
    args: Sequence[Any],
    *,
    plan: BucketPlan,
    axis_name: Any,
    hook: CommHook,
    hook_state: Sequence[Any],
    step: jax.Array,
    phase: Any = None,
    chain: options.Chain = "auto",
    seed: Any = None,
    offset: Sequence[Any] | None = None,
    extras_fn: Callable[[Any], Any] | None = None,
    extras_shape: Any = (),
    sharded: Sharded | None = None,
    hosts_axis: str | None = None,
    precision: precision_lib.MixedPrecision | None = None,
) -> Reduced:
    """Differentiates the first output of ``traced`` with gradients reduced per bucket in backward.

    Must run inside ``shard_map`` or ``pmap`` over ``axis_name``.

    Args:
      traced: the loss traced once; its first output is the scalar that is differentiated.
      param_leaves: the parameter leaves to evaluate it at (replicated or varying).
      args: its other arguments.
      plan: the bucket plan (from the same ``traced``, see :func:`jddp._src.plan.planner.plan_traced`).
      hook_state: one state per leaf (see :func:`jddp._src.reduce.hooks.init_hook_state`).
      step: the optimizer step, passed to hooks.
      phase: the hook's static phase for this step (``hook.phase(step)``).
      chain: how consecutive buckets are kept apart (see :func:`resolve_chain`).
      seed: the cotangent of the differentiated output (default 1): scales every local gradient
        before the reduction (a mean over micro-batches, a loss scale).
      offset: local gradient leaves (already scaled like ``seed``) added before the reduction,
        e.g. the sums of earlier micro-batches; ``None`` for none.
      extras_fn: ``extras_fn(out)`` gives float32 arrays (a pytree shaped like ``extras_shape``)
        to be averaged over the axis, exactly; they ride on the last bucket's collective when it
        averages float32 exactly (``CommHook.fuses_extras``), else take one all-reduce of their
        own. Called once, on the forward output.
      extras_shape: ``jax.ShapeDtypeStruct``s of what ``extras_fn`` returns.
      sharded: a sharded stage's reduction (reduce-scatter, and the forward all-gather at stage
        3); ``None`` for the hook's all-reduce. Stage 3 takes each split leaf's piece in
        ``param_leaves`` and returns pieces of the gradient; stage 2 takes whole leaves and
        returns pieces.
      hosts_axis: the name in ``axis_name`` that crosses hosts on a two-level mesh, for the hook
        (``HookContext.hosts_axis``; see :func:`jddp.hooks.hierarchical`).
    """
    if len(hook_state) != len(param_leaves):
        raise ValueError(
            f"hook_state has {len(hook_state)} entries for {len(param_leaves)} parameter leaves; "
            "build it with jddp.hooks.init_hook_state(hook, params)."
        )
    reducer = make_reducer(plan, hook, axis_name, sharded=sharded, hosts_axis=hosts_axis,
                           phase=phase, stateful=bool(jax.tree.leaves(tuple(hook_state))),
                           precision=precision)
    reducer.check(param_leaves)
    mode = resolve_chain(chain)
    if sharded is not None and mode == "barrier":
        # A sharded stage copies each bucket into one (N, K) matrix anyway: the always-zero add
        # fuses into that copy, not into the GEMMs, and keeps the reduce-scatters in order on GPU,
        # where the barrier did not (the last bucket's was scheduled second).
        mode = "add"
    # Mesh axes the inputs vary over besides the reduced ones (a reduction inside each host of a
    # two-level mesh, with per-host parameters): the reduced values still vary over them, and
    # so must the tokens and extras that carry them.
    names = vma.axis_names(axis_name)
    seen = frozenset().union(*(vma.varying_axes(x) for x in jax.tree.leaves(
        (tuple(param_leaves), tuple(args)))))
    other = tuple(a for a in sorted(seen) if a not in names)
    run = _Run(traced, plan, reducer, mode, other, step, offset)
    return run(param_leaves, hook_state, args, seed, extras_fn, extras_shape)


class _Run(NamedTuple):
    """One reducing differentiation (see :func:`bucketed_vjp`), its static parts."""

    traced: jaxpr_lib.Traced
    plan: BucketPlan
    reducer: BucketReducer
    mode: str
    other: tuple
    step: jax.Array
    offset: Sequence[Any] | None

    def __call__(self, param_leaves: Sequence[jax.Array], hook_state: Sequence[Any],
                 args: Sequence[Any], seed: Any, extras_fn: Callable[[Any], Any] | None,
                 extras_shape: Any) -> Reduced:
        plan, reducer, mode, other = self.plan, self.reducer, self.mode, self.other
        axis_name = reducer.axis_name
        # Hook state is per device by definition (error-feedback residuals differ by replica).
        hook_state = jax.tree.map(lambda x: vma.to_varying(x, axis_name), tuple(hook_state))
        last = plan.num_buckets - 1
        vjps = [_bucket_vjp(reducer, _Slot(b, b == last, mode, self.out_structs(b - 1), other))
                for b in range(plan.num_buckets)]
        run = _Evaluation(self.traced, plan, reducer, vjps, args, self.offset, self.step, mode)
        extras_structs = _f32_structs(jax.tree.leaves(extras_shape))
        everywhere = (*vma.axis_names(axis_name), *other)
        extras_zero = tuple(vma.to_varying(jnp.zeros(e.shape, e.dtype), everywhere)
                            for e in extras_structs)
        token0 = (_dep_zeros(mode, self.out_structs(last), axis_name, other), extras_zero)
        sink0 = tuple(_vary(jnp.zeros(e.shape, e.dtype), other) for e in extras_structs)
        (loss, _), vjp_fn, out = jax.vjp(run, tuple(param_leaves), hook_state,
                                         self.carry(param_leaves), token0, sink0, has_aux=True)
        extras = _extras(extras_fn, extras_shape, out, everywhere)
        if seed is None:
            seed = jnp.ones_like(loss)
        seed = _vary(jnp.asarray(seed, loss.dtype), tuple(sorted(vma.varying_axes(loss))))
        ct_token = (_dep_zeros(mode, [], axis_name, other),
                    extras if plan.num_buckets else extras_zero)
        # The buckets' reduced gradients come back as the carry's cotangent (see _bucket_vjp);
        # the parameters' own is JAX's reduction of the leaves read replicated (plan.implicit).
        leaf_cts, new_states, grad_leaves, _, reduced = vjp_fn((seed, ct_token))
        sent = reducer.unused_bytes()
        for b in range(plan.num_buckets):
            sent = sent + reducer.bytes(b, extras_structs if b == last and extras else (),
                                        self.step)
        if not plan.num_buckets:
            reduced = tuple(lax.pmean(extras, axis_name)) if extras else ()
            sent = sent + reducer.mean_bytes(extras_structs if extras else ())
        if run.regathers:  # reshard_after_forward: each backward use gathers its leaf again
            assert isinstance(reducer, GatherInForward)
            for i in run.regathers:
                sent = sent + reducer.regather_bytes((i,))
        # plan.unused leaves have no gradient path to the loss: state the zero explicitly, so
        # that it is identical on every replica whatever autodiff materialises for them. Nor
        # does their hook state reach a hook, so its "cotangent" is zero: keep the old state
        # instead (a zeroed PowerSGD Q would stay zero).
        unused = frozenset(plan.unused)
        grad_leaves = [jnp.zeros_like(g) if i in unused else g for i, g in enumerate(grad_leaves)]
        if run.casts is not None:
            grad_leaves, jax_sent = _jax_reduced(plan, reducer, run.casts, grad_leaves,
                                                 leaf_cts)
            sent = sent + jax_sent
        kept = unused | frozenset(plan.implicit)  # no hook reads their state
        new_states = [hook_state[i] if i in kept else s for i, s in enumerate(new_states)]
        mean_extras = jax.tree.unflatten(jax.tree.structure(extras_shape), list(reduced))
        return Reduced(out, list(grad_leaves), tuple(new_states), mean_extras, sent)

    def out_structs(self, b: int) -> tuple:
        """What bucket ``b``'s reduction returns (none for ``b < 0``)."""
        return tuple(self.reducer.out_struct(i)
                     for i in (self.plan.buckets[b].indices if b >= 0 else ()))

    def carry(self, param_leaves: Sequence[jax.Array]) -> tuple:
        """Zeros shaped like each reduced leaf, typed like its parameter (see _bucket_vjp)."""
        return tuple(
            vma.to_varying(jnp.zeros(s.shape, s.dtype), tuple(sorted(vma.varying_axes(x))))
            for s, x in zip(map(self.reducer.out_struct, range(len(param_leaves))),
                            param_leaves, strict=True)
        )


def _jax_reduced(plan: BucketPlan, reducer: BucketReducer, casts: replicated.LateCasts,
                 grads: Sequence[Any], sums: Sequence[Any]) -> tuple[list[Any], Bytes]:
    """``grads`` with ``plan.implicit``'s means, from ``sums`` (the parameters' cotangents:
    JAX summed those leaves' over the axis, one ``psum`` per cast in ``casts``), and the bytes
    of those psums."""
    axis_name = reducer.axis_name
    n = axis_size(axis_name)
    grads = [s / jnp.asarray(n, s.dtype) if i in plan.implicit else g
             for i, (g, s) in enumerate(zip(grads, sums, strict=True))]
    group, hosts = span(axis_name, reducer.hosts_axis if isinstance(reducer, AllReduce) else None)
    sent = Bytes()
    for s in casts.casts:
        sent = sent + ring("all-reduce", wire_nbytes(s), group, hosts)
    return grads, sent


def _extras(extras_fn: Callable[[Any], Any] | None, extras_shape: Any, out: Any,
            axes: tuple) -> tuple:
    """The extras of the forward output ``out``, as float32 values varying over ``axes``."""
    if extras_fn is None:
        return ()
    values = extras_fn(out)
    if jax.tree.structure(values) != jax.tree.structure(extras_shape):  # type: ignore[operator]
        raise AssertionError("extras_fn does not match extras_shape")  # a jddp bug, not user's
    return tuple(vma.to_varying(jnp.asarray(e, jnp.float32), axes)
                 for e in jax.tree.leaves(values))


# ------------------------------------------------------------ averaging values (local SGD)


def bucketed_mean(
    leaves: Sequence[jax.Array],
    plan: BucketPlan,
    axis_name: Any,
    *,
    local_axis: Any = None,
    chain: options.Chain = "auto",
    extras: Sequence[jax.Array] = (),
    hook: CommHook | None = None,
    step: Any = 0,
) -> tuple[list[jax.Array], tuple]:
    """The mean over ``axis_name`` of per-replica values shaped like the plan's leaves (local
    SGD's parameters, DiLoCo's parameter deltas), one collective per bucket, in plan order (the
    last layers first), chained like the gradient buckets (:func:`resolve_chain`).

    Leaves the plan leaves out (unused parameters) ride on the last bucket; so do ``extras``
    (float32 values averaged the same way: the step's loss, metrics, model-state payload).

    With ``local_axis`` the values are equal over it (one replica per host, the devices of a
    host holding the same copy): each device of a host averages its ``1/L`` slice of the bucket
    across hosts and an all-gather over ``local_axis`` puts the bucket back together, so a host
    sends the bucket's bytes across once, not ``L`` times. Must run inside ``shard_map`` over
    ``axis_name`` (and ``local_axis``).

    Args:
      hook: a stateless communication hook that averages each bucket (its slice with
        ``local_axis``) over ``axis_name`` instead of the float32 ``psum`` (e.g.
        ``int8_compress(error_feedback=False)``); ``extras`` then travel in their own exact
        ``psum`` (metrics are never compressed), and the in-host gather stays float32.
      step: the step number the hook's context carries (stochastic rounding keys on it).

    Returns:
      ``(means, extras_means)``: the leaves' means (in ``leaves`` order, no longer varying over
      the axes) and the extras' means.
    """
    mode = resolve_chain(chain)
    out: list[Any] = list(leaves)
    extras_out: tuple = tuple(extras)
    groups = [list(b.indices) for b in plan.buckets]
    if plan.unused:
        if groups:
            groups[-1] += list(plan.unused)
        else:
            groups = [list(plan.unused)]
    if not groups:
        groups = [[]]
    dep: Any = None
    for b, idx in enumerate(groups):
        last = b == len(groups) - 1
        vals = tuple(leaves[i] for i in idx)
        if dep is not None and mode == "add":
            vals = tuple(v + dep.astype(v.dtype) for v in vals)
        elif dep is not None and mode == "barrier" and vals:
            vals, _ = lax.optimization_barrier((vals, dep))
        ctx = HookContext(axis_name, axis_size(axis_name), jnp.asarray(step, jnp.int32), b)
        means, riders = _mean_bucket(vals, tuple(extras) if last else (), ctx, local_axis, hook)
        if last:
            extras_out = riders
        for j, m in zip(idx, means, strict=True):
            out[j] = m
        if means:
            dep = chain_dependency(means, mode) if mode != "none" else None
    return out, extras_out


def _mean_bucket(vals: tuple, extras: tuple, ctx: HookContext, local_axis: Any,
                 hook: CommHook | None) -> tuple[tuple, tuple]:
    """One bucket of :func:`bucketed_mean`: ``(means of vals, means of extras)``."""
    axis_name, n = ctx.axis_name, ctx.axis_size
    if local_axis is not None:
        # This device's 1/L slice of each leaf (equal on every device of the host, so the
        # slices need no reduction inside the host), averaged across hosts, then gathered.
        parts, i = axis_size(local_axis), lax.axis_index(local_axis)
        flats = [padded_flat(v, parts) for v in vals]
        sent = tuple(lax.dynamic_slice_in_dim(f, i * (f.shape[0] // parts), f.shape[0] // parts)
                     for f in flats)
    else:
        sent = vals
    riders = tuple(e / n for e in extras)
    if hook is None:
        summed = lax.psum(tuple(v * jnp.asarray(1.0 / n, v.dtype) for v in sent) + riders,
                          axis_name)
        reduced, riders = summed[: len(sent)], summed[len(sent):]
    else:
        out = hook.reduce(sent, tuple(() for _ in sent), ctx) if sent else ((), ())
        reduced, _ = _check_hook_output(hook, sent, out, ctx.bucket_index)
        _check_reduced(hook, reduced, axis_name, ctx.bucket_index)
        riders = lax.psum(riders, axis_name) if riders else ()
    if local_axis is None:
        return tuple(reduced), tuple(riders)
    full = gather_invariant(tuple(reduced), local_axis, axis=0, tiled=True)
    return tuple(unflatten_like(f, v) for f, v in zip(full, vals, strict=True)), tuple(riders)


# ----------------------------------------------------------------------------- the drop-in


def _check_local_loss(traced: jaxpr_lib.Traced, params_v: Any, axis_name: Any) -> None:
    """Refuses a loss reduced over ``axis_name`` (``lax.pmean(loss, axis)``) where vma types are
    tracked: typed invariant, its transpose would hand each device 1/N of its gradient (without
    types, under ``pmap``, the reduction's transpose sums and the gradient is right)."""
    tracked = any(vma.varying_axes(x) for x in jax.tree.leaves(params_v))
    out = traced.jaxpr.jaxpr.outvars[0]
    if not tracked or jaxpr_lib.is_literal(out):
        return
    varying = vma.aval_varying_axes(out.aval)
    missing = [a for a in vma.axis_names(axis_name) if a not in varying]
    if missing:
        raise ValueError(
            f"jddp.value_and_grad: fun returns a loss already reduced over {missing[0]!r} "
            "(lax.pmean/lax.psum of the loss): its gradient would be 1/N of the right one. "
            "Return this device's own loss; value_and_grad's gradients are already averaged "
            "over the axis, and the value it returns is local: reduce that value after the "
            f"call if you want it (loss = lax.pmean(loss, {missing[0]!r}), docs/migration.md)."
        )


def value_and_grad(
    fun: Callable[..., Any],
    axis_name: Any = "data",
    *,
    cap_mb: float | None = None,
    first_mb: float | None = None,
    has_aux: bool = False,
    hook: CommHook | None = None,
    plan: BucketPlan | None = None,
    chain: options.Chain = "auto",
    **renamed: Any,
) -> Callable[..., Any]:
    """Drop-in for ``jax.value_and_grad`` inside ``shard_map`` or ``pmap``: bucketed, averaged grads.

    ``jddp.value_and_grad(loss_fn)(params, *args)`` returns ``(value, grads)`` where ``value`` is
    this device's loss (and aux) and ``grads`` is the mean over ``axis_name`` of every device's
    gradient, reduced bucket by bucket from inside the backward pass. It works with ``check_vma``
    on or off and inside ``jax.pmap``; parameters may be replicated or already varying.

    Args:
      fun: ``fun(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux``); differentiated with
        respect to its first argument.
      cap_mb: bucket cap in MiB (DDP's ``bucket_cap_mb``; ``jddp.Buckets(cap_mb=...)``). Not
        given: DDP's default plan (25 MiB after a 1 MiB first bucket) — not the cost model's
        plan that :class:`jddp.DataParallel` takes when no cap is given; pass the caps its
        ``cap_choice.pin`` names for the same plan.
      first_mb: cap of the first bucket in MiB (default: DDP's rule, see
        :class:`jddp.Buckets`).
      hook: a stateless communication hook for each bucket (stateful hooks need
        :class:`jddp.DataParallel`, which carries their state).
      plan: a precomputed bucket plan; by default one is made from ``fun``'s traced use order.
      chain: how buckets are kept apart in XLA: ``"auto"`` (``"barrier"`` on GPU, ``"add"`` on
        CPU and TPU), ``"add"``, ``"barrier"``, or ``"none"`` to let XLA combine them.
      **renamed: ``bucket_cap_mb``/``first_bucket_mb``, the old names of ``cap_mb``/``first_mb``
        (deprecated: a ``DeprecationWarning``, the same plan and bits).
    """
    options.chain(chain)
    cap, first = options.renamed_caps("value_and_grad", cap_mb, first_mb, renamed)
    the_hook = allreduce_mean() if hook is None else check_hook(hook)

    @functools.wraps(fun)
    def wrapped(params, *args):
        check_float_params(params)
        leaves = jax.tree.leaves(params)
        # Traced with the parameters as the hooks deliver them (varying), once.
        params_v = jax.tree.map(lambda x: vma.to_varying(x, axis_name), params)
        traced = jaxpr_lib.trace(fun, params_v, *args)
        check_scalar_loss(traced.out_shapes[0] if has_aux else traced.out_shapes)
        _check_local_loss(traced, params_v, axis_name)
        if plan is not None:
            plan.check_tree(params)
        the_plan = plan or plan_traced(
            traced, params, cap_bytes=cap, first_bytes=first, loss_outputs=1
        )
        red = bucketed_vjp(
            traced, leaves, args, plan=the_plan, axis_name=axis_name, hook=the_hook,
            hook_state=init_hook_state(the_hook, params),
            step=jnp.zeros((), jnp.int32), chain=chain,
        )
        return red.out, jax.tree.unflatten(jax.tree.structure(params), red.grads)

    return wrapped
