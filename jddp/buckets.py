"""Gradient buckets: which parameters are reduced together, and in what order.

Like PyTorch DDP, gradients are packed into size-capped buckets in the order in which the backward
pass produces them (reverse order of first use in the forward pass), with a small first bucket so
that communication starts early. Unlike DDP, the order is read from the traced computation before
the first iteration (DDP rebuilds its buckets after iteration 1), so no warm-up step is needed.

A bucket is a group of leaves, never a concatenated buffer: on CPU the copies of a flat buffer cost
more than they save (../shared/README.md §2), and one ``psum`` over the tuple of a bucket's leaves is
a single all-reduce in XLA either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

MiB = 1024 * 1024

# Primitives whose sub-jaxpr is walked (and, when evaluating, inlined) as if it were written out in
# place: plain calls whose inputs map one-to-one on the callee's inputs.
_INLINE_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})


class Bucket(NamedTuple):
    """One bucket: leaves reduced by a single all-reduce.

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
        in no bucket and get zero gradients.
      treedef: the parameter tree structure the plan was built for.
      shapes: every leaf's shape, in tree-leaf order.
      dtypes: every leaf's dtype, in tree-leaf order.
      paths: every leaf's key path, in tree-leaf order.
      cap_bytes: the bucket cap.
      first_bytes: the cap of the first bucket (per dtype).
    """

    buckets: tuple[Bucket, ...]
    unused: tuple[int, ...]
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    paths: tuple[str, ...]
    cap_bytes: int
    first_bytes: int

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

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
            if tuple(np.shape(leaf)) != shape or np.dtype(_dtype(leaf)) != dtype:
                raise ValueError(
                    f"Parameter {path} is {_dtype(leaf)}{list(np.shape(leaf))} but the bucket plan "
                    f"was built for {dtype}{list(shape)}. Build a new plan for these params."
                )

    def table(self) -> str:
        """A readable table: one row per bucket with its bytes and parameter paths."""
        rows = [
            f"BucketPlan: {self.num_buckets} buckets, {_fmt_bytes(self.total_bytes)}, "
            f"cap {_fmt_bytes(self.cap_bytes)}, first bucket {_fmt_bytes(self.first_bytes)}"
        ]
        rows.append(f"{'#':>3}  {'bytes':>10}  {'dtype':<9} {'leaves':>6}  parameters")
        for i, b in enumerate(self.buckets):
            names = ", ".join(b.paths)
            if len(names) > 90:
                names = names[:87] + "..."
            rows.append(
                f"{i:>3}  {_fmt_bytes(b.nbytes):>10}  {str(b.dtype):<9} {len(b.indices):>6}  {names}"
            )
        if self.unused:
            rows.append(
                "unused (no gradient, not reduced): "
                + ", ".join(self.paths[i] for i in self.unused)
            )
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _fmt_bytes(n: int) -> str:
    if n >= MiB:
        return f"{n / MiB:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)


def cap_to_bytes(mb: float, name: str) -> int:
    """Converts a cap in MiB to bytes, with a clear error for a cap that is not positive."""
    try:
        value = float(mb)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number of MiB, got {mb!r}.") from None
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ValueError(
            f"{name} must be a positive, finite number of MiB, got {mb!r}. "
            f"DDP's defaults are bucket_cap_mb=25.0 and first_bucket_mb=1.0."
        )
    return max(1, int(value * MiB))


def assign_buckets(
    nbytes: Sequence[int], dtypes: Sequence[Any], cap_bytes: int, first_bytes: int
) -> list[list[int]]:
    """Groups leaves, given in backward order, into size-capped buckets.

    Follows DDP's ``compute_bucket_assignment_by_size``: each dtype has its own open bucket; the
    first bucket of each dtype is capped at ``first_bytes``, later ones at ``cap_bytes``. A leaf that
    would overflow the open bucket closes it first, so every bucket stays within its cap except a
    single leaf that is larger than the cap on its own.

    Args:
      nbytes: bytes of each leaf, in the order its gradient becomes ready.
      dtypes: each leaf's dtype; a bucket never mixes dtypes.
      cap_bytes: the cap for all buckets but the first.
      first_bytes: the cap of the first bucket (of each dtype).

    Returns:
      Buckets as lists of positions into ``nbytes``, ordered by when they are complete (the position
      of their last leaf), which is the order in which they can be reduced.
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
    n_closed: dict[np.dtype, int] = {}
    closed: list[list[int]] = []
    for pos, (size, dtype) in enumerate(zip(nbytes, dtypes, strict=True)):
        dtype = np.dtype(dtype)
        limit = first_bytes if n_closed.get(dtype, 0) == 0 else cap_bytes
        current = open_buckets.setdefault(dtype, [])
        if current and open_size[dtype] + size > limit:
            closed.append(current)
            n_closed[dtype] = n_closed.get(dtype, 0) + 1
            current = open_buckets[dtype] = []
            open_size[dtype] = 0
            limit = cap_bytes
        current.append(pos)
        open_size[dtype] = open_size.get(dtype, 0) + size
        if open_size[dtype] >= limit:
            closed.append(current)
            n_closed[dtype] = n_closed.get(dtype, 0) + 1
            open_buckets[dtype] = []
            open_size[dtype] = 0
    closed.extend(b for b in open_buckets.values() if b)
    closed.sort(key=max)
    return closed


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, list[Any]]]:
    """The sub-jaxprs of an equation, each with the outer variables bound to its inputs."""
    params = eqn.params
    name = eqn.primitive.name
    out = []
    if name == "cond":
        for branch in params["branches"]:
            out.append((branch.jaxpr, list(eqn.invars[1:])))
        return out
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        carry = list(eqn.invars[nc + nb :])
        out.append((params["cond_jaxpr"].jaxpr, list(eqn.invars[:nc]) + carry))
        out.append((params["body_jaxpr"].jaxpr, list(eqn.invars[nc : nc + nb]) + carry))
        return out
    for value in params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            jaxpr: Any = getattr(sub, "jaxpr", sub)
            if hasattr(jaxpr, "eqns") and hasattr(jaxpr, "invars"):
                if len(jaxpr.invars) == len(eqn.invars):
                    out.append((jaxpr, list(eqn.invars)))
                else:
                    # Unknown binding convention: count every input as used right here.
                    out.append((None, list(eqn.invars)))
    return out


def first_use_order(jaxpr: Any, num_params: int) -> list[int | None]:
    """The time of first use of each of the first ``num_params`` inputs of ``jaxpr``.

    Times count equations in evaluation order, walking into sub-jaxprs (calls, loops, branches,
    custom derivatives), so a model wrapped in one ``jit`` still has a per-layer order. ``None``
    marks an input that no equation and no output uses.
    """
    first: dict[Any, int] = {}
    clock = [0]

    def walk(jx: Any, binding: dict[Any, int]) -> None:
        for eqn in jx.eqns:
            clock[0] += 1
            subs = _sub_jaxprs(eqn)
            used_here = [v for v in eqn.invars if not _is_literal(v) and v in binding]
            if not subs:
                for v in used_here:
                    first.setdefault(binding[v], clock[0])
                continue
            for sub, outer in subs:
                inner = {}
                for ov, iv in zip(outer, sub.invars if sub is not None else outer, strict=True):
                    if not _is_literal(ov) and ov in binding:
                        inner[iv] = binding[ov]
                if sub is None:
                    for idx in inner.values():
                        first.setdefault(idx, clock[0])
                else:
                    walk(sub, inner)
        for v in jx.outvars:
            if not _is_literal(v) and v in binding:
                clock[0] += 1
                first.setdefault(binding[v], clock[0])

    walk(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[:num_params])})
    return [first.get(i) for i in range(num_params)]


def _is_literal(v: Any) -> bool:
    return not hasattr(v, "count") and hasattr(v, "val")


def key_path_str(path: Sequence[Any]) -> str:
    """A readable dotted path for a pytree key path, e.g. ``params.Dense_0.kernel``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts) or "<root>"


def make_plan(
    params: Any,
    use_times: Sequence[int | None],
    *,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
) -> BucketPlan:
    """Builds a plan from each leaf's first-use time (``None`` for unused leaves).

    Leaves are ordered by first use, latest first (the order backward produces their gradients);
    leaves with equal times keep reverse tree order.
    """
    cap = cap_to_bytes(bucket_cap_mb, "bucket_cap_mb")
    first = cap_to_bytes(first_bucket_mb, "first_bucket_mb")
    if first > cap:
        raise ValueError(
            f"first_bucket_mb ({first_bucket_mb}) is larger than bucket_cap_mb ({bucket_cap_mb}); "
            "the first bucket is meant to be small. Lower first_bucket_mb or raise bucket_cap_mb."
        )
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in path_leaves]
    paths = tuple(key_path_str(p) for p, _ in path_leaves)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    dtypes = tuple(_dtype(x) for x in leaves)
    nbytes = [int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
    if len(use_times) != len(leaves):
        raise ValueError(f"{len(use_times)} use times for {len(leaves)} leaves.")
    used = [i for i, t in enumerate(use_times) if t is not None]
    unused = tuple(i for i, t in enumerate(use_times) if t is None)
    order = sorted(used, key=lambda i: (use_times[i], i), reverse=True)
    groups = assign_buckets([nbytes[i] for i in order], [dtypes[i] for i in order], cap, first)
    buckets = tuple(
        Bucket(
            indices=tuple(order[p] for p in g),
            paths=tuple(paths[order[p]] for p in g),
            nbytes=sum(nbytes[order[p]] for p in g),
            dtype=dtypes[order[g[0]]],
        )
        for g in groups
    )
    return BucketPlan(buckets, unused, treedef, shapes, dtypes, paths, cap, first)


def plan_buckets(
    fun: Callable[..., Any],
    params: Any,
    *args: Any,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    keep_unused: bool = False,
) -> BucketPlan:
    """Plans buckets for ``fun(params, *args)`` from the order in which it first uses each leaf.

    Leaves with no gradient path to the output (see :func:`jddp.unused.grad_reachable`) go to
    ``plan.unused`` and into no bucket, unless ``keep_unused``.

    Args:
      fun: the loss function; it is traced (not run) on ``params`` and ``args``, which may be arrays
        or ``jax.ShapeDtypeStruct``s. Every output counts as loss.
      keep_unused: put every leaf in a bucket, even those whose gradient is zero by construction
        (they are reduced last).
    """
    from jddp.unused import grad_reachable  # jddp.unused imports this module

    closed = jax.make_jaxpr(fun)(params, *args)
    n = len(jax.tree.leaves(params))
    times = first_use_order(closed.jaxpr, n)
    reach = grad_reachable(closed.jaxpr, n)
    # A leaf that can reach the loss without a first use (a custom derivative that the primal does
    # not read) is reduced last; time 0 puts it in the last bucket. Likewise every leaf with
    # keep_unused.
    times = [
        (0 if t is None else t) if (r or keep_unused) else None
        for t, r in zip(times, reach, strict=True)
    ]
    return make_plan(params, times, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
