"""Gradient buckets: which parameters are reduced together, and in what order.

DDP's packing (size-capped buckets in backward order, a small first bucket), with the order read
from the traced loss before the first iteration. A bucket is a group of leaves, never a
concatenated buffer (on CPU the copies cost more than they save; docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jddp._src.api import options
from jddp._src.core.bytemodel import fmt_bytes
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.tree import dtype_of, key_path_str


class Bucket(NamedTuple):
    """One bucket: leaves reduced by a single collective.

    Attributes:
      indices: positions of the bucket's leaves in ``jax.tree.leaves(params)``, in the order the
        backward pass produces their gradients.
      paths: the leaves' key paths, as readable strings.
      nbytes: total bytes of the bucket's gradients.
      dtype: the one dtype of every leaf in the bucket.
    """

    indices: tuple[int, ...]
    paths: tuple[str, ...]
    nbytes: int
    dtype: np.dtype


class BucketPlan(NamedTuple):
    """The bucket assignment for one parameter tree.

    Attributes:
      buckets: in reduction order (bucket 0 is reduced first: the last layers of the model).
      unused: indices of leaves with no gradient path to the loss in the traced computation (no use
        at all, or uses that reach the loss only through integers or ``stop_gradient``); they are
        in no bucket, get zero gradients, and a step leaves their values unchanged.
      treedef: the parameter tree structure the plan was built for.
      shapes: every leaf's shape, in tree-leaf order.
      dtypes: every leaf's dtype, in tree-leaf order.
      paths: every leaf's key path, in tree-leaf order.
      cap_bytes: the bucket cap.
      first_bytes: the cap of the first bucket (per dtype).
      note: how the cap was chosen, printed with the table (``Buckets(cap_mb="auto")``, or the
        default plan when it is not DDP's).
      implicit: indices of leaves in no bucket that are read replicated, so that JAX's own
        transpose reduces their gradients where their computation meets per-device values
        (the default plan's parameters first combined with the model's cross-replica
        statistics, SyncBatchNorm's scales).
      not_resharded: at ``jddp.ZeRO(stage=3)`` with ``reshard_after_forward``, the leaves whose
        gathered copies stay whole from the forward to the backward pass all the same, because
        the loss computes from them a value the backward cannot recompute
        (docs/sharded.md says which and why); empty when every leaf is
        resharded, or without resharding.
    """

    buckets: tuple[Bucket, ...]
    unused: tuple[int, ...]
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    paths: tuple[str, ...]
    cap_bytes: int
    first_bytes: int
    note: str = ""
    implicit: tuple[int, ...] = ()
    not_resharded: tuple[int, ...] = ()

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def leaf_structs(self, bucket: int) -> list[jax.ShapeDtypeStruct]:
        """Shape structs of the leaves of bucket ``bucket`` (none for a negative index)."""
        if bucket < 0:
            return []
        return [jax.ShapeDtypeStruct(self.shapes[i], self.dtypes[i])
                for i in self.buckets[bucket].indices]

    def check_tree(self, params: Any) -> None:
        """Raises ValueError unless ``params`` has the structure, shapes and dtypes of the plan."""
        treedef = jax.tree.structure(params)
        if treedef != self.treedef:
            raise ValueError(
                "The params tree does not match the tree the bucket plan was built for:\n"
                f"  plan:   {self.treedef}\n  params: {treedef}\n"
                "Build a new plan for these params (jddp.plan_buckets / DataParallel.plan), or pass "
                "the params the plan was made from."
            )
        for path, leaf, shape, dtype in zip(
            self.paths, jax.tree.leaves(params), self.shapes, self.dtypes, strict=True
        ):
            if tuple(np.shape(leaf)) != shape or dtype_of(leaf) != dtype:
                raise ValueError(
                    f"Parameter {path} is {dtype_of(leaf)}{list(np.shape(leaf))} but the bucket "
                    f"plan was built for {dtype}{list(shape)}. Build a new plan for these params."
                )

    def table(self) -> str:
        """A readable table: one row per bucket with its bytes and parameter paths."""
        rows = [
            f"BucketPlan: {self.num_buckets} buckets, {fmt_bytes(self.total_bytes)}, "
            f"cap {fmt_bytes(self.cap_bytes)}, first bucket {fmt_bytes(self.first_bytes)}"
            + (f" ({self.note})" if self.note else "")
        ]
        rows.append(f"{'#':>3}  {'bytes':>10}  {'dtype':<9} {'leaves':>6}  parameters")
        for i, b in enumerate(self.buckets):
            rows.append(
                f"{i:>3}  {fmt_bytes(b.nbytes):>10}  {str(b.dtype):<9} {len(b.indices):>6}  "
                f"{_clipped(b.paths)}"
            )
        if self.implicit:
            rows.append(f"  -  {len(self.implicit)} leaves reduced by JAX where they meet "
                        f"per-device values (no bucket): "
                        f"{_clipped([self.paths[i] for i in self.implicit])}")
        if self.not_resharded:
            rows.append(f"  -  {len(self.not_resharded)} leaves NOT resharded after the forward "
                        "(kept whole until the backward): "
                        f"{_clipped([self.paths[i] for i in self.not_resharded])}")
        if self.unused:
            rows.append(
                "unused (no gradient, not reduced): "
                + ", ".join(self.paths[i] for i in self.unused)
            )
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _clipped(paths: Sequence[str], width: int = 90) -> str:
    """``paths`` joined for one table row, cut to ``width`` characters."""
    names = ", ".join(paths)
    return names if len(names) <= width else names[: width - 3] + "..."


def backward_sizes(plan: BucketPlan) -> tuple[list[int], list[np.dtype]]:
    """Each used leaf's gradient bytes and dtype, in the plan's order (each dtype's leaves in
    backward order, which is all that DDP's packing rule reads)."""
    order = [i for b in plan.buckets for i in b.indices]
    nbytes = [int(np.prod(plan.shapes[i], dtype=np.int64)) * plan.dtypes[i].itemsize
              for i in order]
    return nbytes, [plan.dtypes[i] for i in order]


def bucket_sizes(nbytes: Sequence[int], dtypes: Sequence[Any], cap_mb: float,
                 first_mb: float) -> tuple[int, ...]:
    """The bytes of each bucket DDP's rule packs the leaves into (``first_mb`` clipped to the
    cap)."""
    cap = options.cap_bytes(cap_mb, "bucket_cap_mb")
    first = min(options.cap_bytes(first_mb, "first_bucket_mb"), cap)
    return tuple(sum(nbytes[k] for k in b) for b in assign_buckets(nbytes, dtypes, cap, first))


def assign_buckets(
    nbytes: Sequence[int], dtypes: Sequence[Any], cap_bytes: int, first_bytes: int
) -> list[list[int]]:
    """Groups leaves, given in backward order, into size-capped buckets: DDP's rule.

    PyTorch's ``compute_bucket_assignment_by_size``: each dtype has its own open bucket; a leaf is
    added to its dtype's open bucket, and the bucket is closed as soon as its size reaches the
    limit, which is ``first_bytes`` for a dtype's first bucket and ``cap_bytes`` after. A bucket
    therefore exceeds its limit by less than its last leaf, and a leaf larger than the cap closes
    the bucket it lands in.

    Args:
      nbytes: bytes of each leaf, in the order its gradient becomes ready.
      dtypes: each leaf's dtype; a bucket never mixes dtypes.
      cap_bytes: the limit of every bucket but the first of each dtype.
      first_bytes: the limit of the first bucket of each dtype.

    Returns:
      Buckets as lists of positions into ``nbytes``, ordered by when they are complete (the
      position of their last leaf), which is the order in which they can be reduced.
    """
    if cap_bytes <= 0 or first_bytes <= 0:
        raise ValueError(f"caps must be positive, got cap={cap_bytes}, first={first_bytes}.")
    if first_bytes > cap_bytes:
        raise ValueError(
            f"The first bucket ({first_bytes} bytes) must not be larger than the cap "
            f"({cap_bytes} bytes): lower first_bucket_mb or raise bucket_cap_mb."
        )
    open_buckets: dict[np.dtype, list[int]] = {}
    open_size: dict[np.dtype, int] = {}
    limit: dict[np.dtype, int] = {}
    closed: list[list[int]] = []
    for pos, (size, dtype) in enumerate(zip(nbytes, dtypes, strict=True)):
        dtype = np.dtype(dtype)
        open_buckets.setdefault(dtype, []).append(pos)
        open_size[dtype] = open_size.get(dtype, 0) + int(size)
        if open_size[dtype] >= limit.setdefault(dtype, first_bytes):
            closed.append(open_buckets.pop(dtype))
            open_size[dtype] = 0
            limit[dtype] = cap_bytes
    closed.extend(b for b in open_buckets.values() if b)
    closed.sort(key=max)
    return closed


def make_plan(
    params: Any,
    use_times: Sequence[int | None],
    *,
    cap_mb: float | None = None,
    first_mb: float | None = None,
    **renamed: Any,
) -> BucketPlan:
    """Builds a plan from each leaf's first-use time (``None`` for unused leaves).

    Leaves are ordered by first use, latest first (the order backward produces their gradients);
    leaves with equal times keep reverse tree order.

    Args:
      params: the parameters (arrays or shape structs).
      use_times: one per leaf of ``params``.
      cap_mb: the bucket cap in MiB (``jddp.Buckets(cap_mb=...)``).
      first_mb: the first bucket's cap in MiB (default: DDP's rule, see :class:`jddp.Buckets`).
      **renamed: ``bucket_cap_mb``/``first_bucket_mb``, the old names (deprecated).
    """
    cap, first = options.renamed_caps("make_plan", cap_mb, first_mb, renamed)
    return build_plan(params, use_times, cap, first)


def build_plan(
    params: Any, use_times: Sequence[int | None], cap_bytes: int, first_bytes: int,
    implicit: Sequence[int] = (),
) -> BucketPlan:
    """The plan from each leaf's first-use time (``None``: unused), caps in bytes; the used
    leaves in ``implicit`` go in no bucket (``BucketPlan.implicit``)."""
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in path_leaves]
    paths = tuple(key_path_str(p) for p, _ in path_leaves)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    dtypes = tuple(dtype_of(x) for x in leaves)
    nbytes = [int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
    if len(use_times) != len(leaves):
        raise ValueError(f"{len(use_times)} use times for {len(leaves)} leaves.")
    implicit = tuple(sorted(i for i in set(implicit) if use_times[i] is not None))
    used = [i for i, t in enumerate(use_times) if t is not None and i not in implicit]
    unused = tuple(i for i, t in enumerate(use_times) if t is None)
    order = sorted(used, key=lambda i: (use_times[i], i), reverse=True)
    groups = assign_buckets(
        [nbytes[i] for i in order], [dtypes[i] for i in order], cap_bytes, first_bytes
    )
    buckets = tuple(
        Bucket(
            indices=tuple(order[p] for p in g),
            paths=tuple(paths[order[p]] for p in g),
            nbytes=sum(nbytes[order[p]] for p in g),
            dtype=dtypes[order[g[0]]],
        )
        for g in groups
    )
    return BucketPlan(buckets, unused, treedef, shapes, dtypes, paths, cap_bytes, first_bytes,
                      implicit=implicit)


def plan_traced(
    traced: jaxpr_lib.Traced,
    params: Any,
    *,
    cap_bytes: int,
    first_bytes: int,
    keep_unused: bool = False,
    loss_outputs: int | None = None,
) -> BucketPlan:
    """The plan for a traced loss: first-use order and reachability from its one jaxpr.

    Args:
      keep_unused: put every leaf in a bucket, even those whose gradient is zero by construction.
      loss_outputs: how many leading outputs are differentiated (default: all).
    """
    times = traced_use_times(traced, keep_unused=keep_unused, loss_outputs=loss_outputs)
    return build_plan(params, times, cap_bytes, first_bytes)


def traced_use_times(
    traced: jaxpr_lib.Traced, *, keep_unused: bool = False, loss_outputs: int | None = None
) -> list[int | None]:
    """Each parameter leaf's first-use time in the traced loss (``None``: no gradient path),
    what :func:`build_plan` packs; arguments as :func:`plan_traced`'s."""
    jx = traced.jaxpr.jaxpr
    n = traced.num_params
    live = None
    if loss_outputs is not None:
        live = [i < loss_outputs for i in range(len(jx.outvars))]
    times = jaxpr_lib.first_use_order(jx, n)
    reach = jaxpr_lib.grad_reachable(jx, n, live)
    # A leaf that can reach the loss without a first use (a custom derivative that the primal does
    # not read) is reduced last; time 0 puts it in the last bucket. Likewise every leaf with
    # keep_unused.
    return [
        (0 if t is None else t) if (r or keep_unused) else None
        for t, r in zip(times, reach, strict=True)
    ]


def plan_buckets(
    fun: Callable[..., Any],
    params: Any,
    *args: Any,
    cap_mb: float | None = None,
    first_mb: float | None = None,
    keep_unused: bool = False,
    **renamed: Any,
) -> BucketPlan:
    """Plans buckets for ``fun(params, *args)`` from the order in which it first uses each leaf.

    Leaves with no gradient path to the output go to ``plan.unused`` and into no bucket, unless
    ``keep_unused``. For a :class:`jddp.DataParallel` step, ``ddp.plan(params, batch)`` gives the
    plan the step uses (same planner, the step's own loss; with no cap given, the cost model's
    plan, where this function keeps DDP's default caps).

    Args:
      fun: the loss function; it is traced (not run) on ``params`` and ``args``, which may be arrays
        or ``jax.ShapeDtypeStruct``s. Every output counts as loss.
      cap_mb: the bucket cap in MiB (default: DDP's 25), as ``jddp.Buckets(cap_mb=...)``.
      first_mb: the first bucket's cap in MiB (default: DDP's rule, see
        :class:`jddp.Buckets`).
      keep_unused: put every leaf in a bucket, even those whose gradient is zero by construction
        (they are reduced last).
      **renamed: ``bucket_cap_mb``/``first_bucket_mb``, the old names of ``cap_mb``/``first_mb``
        (deprecated: a ``DeprecationWarning``, the same plan).
    """
    cap, first = options.renamed_caps("plan_buckets", cap_mb, first_mb, renamed)
    traced = jaxpr_lib.trace(fun, params, *args)
    return plan_traced(traced, params, cap_bytes=cap, first_bytes=first, keep_unused=keep_unused)


def unused_message(paths: Sequence[str]) -> str:
    """The one-time warning that names the parameters left out of the buckets."""
    shown = ", ".join(paths[:20]) + (f", ... ({len(paths) - 20} more)" if len(paths) > 20 else "")
    return (
        f"{len(paths)} parameter leaves have no gradient path to the loss: {shown}. They are left "
        "out of the gradient buckets (nothing is sent for them) and out of the update (they keep "
        "their values, no weight decay: PyTorch's optimizers skip a None gradient). If this is "
        "unexpected, check that the loss uses them; pass reduce=jddp.Buckets(keep_unused=True) to "
        "reduce them and let the optimizer update them anyway."
    )
