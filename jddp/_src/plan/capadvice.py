"""The bucket-cap advisor: every candidate cap's predicted iteration, and the fastest.

Public as part of :mod:`jddp.perf.costmodel`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from jddp._src.api import options
from jddp._src.core.bytemodel import nbytes as leaf_nbytes
from jddp._src.plan.costmodel import (
    ClusterSpec,
    IterationEstimate,
    ModelProfile,
    simulate_iteration,
)
from jddp._src.plan.planner import BucketPlan, backward_sizes
from jddp._src.tree import MiB

__all__ = ["DEFAULT_CAP_CANDIDATES_MB", "CapAdvice", "advise_bucket_cap", "suggest_bucket_cap"]

#: Caps (MiB) that :func:`advise_bucket_cap` tries by default; "inf" puts every gradient of a
#: dtype in one bucket, the "no bucketing" extreme of the paper's sweep.
DEFAULT_CAP_CANDIDATES_MB: tuple[float, ...] = (
    0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, math.inf,
)


class CapAdvice(NamedTuple):
    """The outcome of :func:`advise_bucket_cap`.

    Attributes:
      cap_mb: the candidate with the lowest predicted iteration time (the smallest one among
        candidates within ``tolerance`` of the best, since smaller buckets start earlier and
        need less staging memory).
      predictions: ``(cap_mb, estimate)`` for every candidate, in the order tried.
      cluster: the cluster the advice is for.
    """

    cap_mb: float
    predictions: tuple[tuple[float, IterationEstimate], ...]
    cluster: ClusterSpec

    def same_buckets(self) -> dict[float, float]:
        """For each candidate, the first candidate that cuts the gradients into the same buckets.

        A prediction is a function of the buckets (which leaves, in which order), so caps that
        cut alike predict identical times: every cap at or above the model's gradient bytes
        gives the first bucket (``first_mb``) and one more, or one bucket if the whole
        model fits in the first (a small model: the example LM's 0.97 MiB of gradients fit in
        the default 1 MiB first bucket, so caps from 1 MiB up all predict the same iteration).
        """
        seen: dict[tuple, float] = {}
        out = {}
        for cap, est in self.predictions:
            out[cap] = seen.setdefault(_grouping(est), cap)
        return out

    @property
    def note(self) -> str:
        """Why some predictions are identical ("" when every candidate cuts differently)."""
        first = self.same_buckets()
        if len(set(first.values())) == len(first):
            return ""
        est = self.predictions[0][1]
        total = sum(b.nbytes for b in est.buckets) / MiB
        if len(set(first.values())) == 1:
            return (
                f"Every candidate cap cuts the {total:.3g} MiB of gradients into the same "
                f"{est.num_buckets} bucket(s) (first bucket {est.first_bytes / MiB:g} MiB), so "
                "every prediction is identical: the cap does not matter for this model. Smaller "
                "caps (or a smaller first_mb) are the only ones that change the plan."
            )
        alike = sorted({c for c, f in first.items() if c != f})
        return (
            f"Caps {', '.join(_fmt_cap(c) for c in alike)} cut the {total:.3g} MiB of gradients "
            "like a smaller candidate (marked '=' in the table) and predict the same time."
        )

    def table(self) -> str:
        """One row per candidate: predicted iteration, exposed communication, buckets."""
        rows = [
            f"{'cap MiB':>8} {'buckets':>7} {'iter ms':>9} {'exposed ms':>10} {'comm ms':>9} "
            f"{'overlap':>7}"
        ]
        first = self.same_buckets()
        for cap, est in self.predictions:
            mark = "  <- suggested" if cap == self.cap_mb else ""
            if first[cap] != cap:
                mark += f"  (= {_fmt_cap(first[cap])}: same buckets)"
            rows.append(
                f"{_fmt_cap(cap):>8} {est.num_buckets:>7} {est.iteration_s * 1e3:>9.3f} "
                f"{est.exposed_comm_s * 1e3:>10.3f} {est.comm_s * 1e3:>9.3f} "
                f"{est.overlap_fraction:>7.0%}{mark}"
            )
        return "\n".join(rows + ([self.note] if self.note else []))

    def __str__(self) -> str:
        return self.table()


def _grouping(est: IterationEstimate) -> tuple[tuple[int, ...], ...]:
    """Which leaves each bucket of a prediction holds, in order: the plan it was predicted for."""
    return tuple(b.leaves for b in est.buckets)


def _fmt_cap(cap: float) -> str:
    return "all" if math.isinf(cap) else f"{cap:g}"


def _as_profile(
    model: Any,
    *,
    backward_s: float | None,
    forward_s: float,
    optimizer_s: float,
) -> ModelProfile:
    """Builds a profile from a ModelProfile, a BucketPlan, a params pytree or leaf byte sizes."""
    if isinstance(model, ModelProfile):
        return model

    if isinstance(model, BucketPlan):
        nbytes, dtypes = backward_sizes(model)
        names = [model.paths[i] for b in model.buckets for i in b.indices]
    elif isinstance(model, Sequence) and all(isinstance(x, int | np.integer) for x in model):
        nbytes, dtypes, names = [int(x) for x in model], [], []
    else:
        import jax  # only needed for pytrees

        leaves = jax.tree.leaves(model)
        # Without a traced use order, assume the tree's leaf order is the forward order, so the
        # backward produces gradients in reverse. Pass ddp.plan(params, batch) for the real order.
        leaves = leaves[::-1]
        nbytes = [leaf_nbytes(x) for x in leaves]
        dtypes = [np.dtype(x.dtype) for x in leaves]
        names = []
    if backward_s is None:
        raise ValueError(
            "The cost model needs compute times to weigh overlap against per-bucket latency: pass "
            "backward_s= (seconds of one device's backward pass), or a ModelProfile (see "
            "jddp.perf.calibrate.profile_step to measure one, or ModelProfile.from_flops)."
        )
    return ModelProfile.from_sizes(
        nbytes, backward_s=backward_s, forward_s=forward_s, optimizer_s=optimizer_s,
        dtypes=dtypes, names=names,
    )


def advise_bucket_cap(
    model: Any,
    cluster: ClusterSpec,
    *,
    candidates_mb: Iterable[float] = DEFAULT_CAP_CANDIDATES_MB,
    first_mb: float | None = None,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    optimizer_s: float = 0.0,
    tolerance: float = 0.0,
    **renamed: Any,
) -> CapAdvice:
    """Predicts the iteration for each candidate bucket cap and picks the fastest.

    Args:
      model: a :class:`ModelProfile`; or a :class:`jddp.buckets.BucketPlan` (its bucket order is the
        backward order); or a params pytree (reverse leaf order assumed); or gradient byte sizes
        in backward order. For all but a profile, ``backward_s`` is spread over leaves in
        proportion to their size.
      cluster: the devices and links to plan for.
      candidates_mb: caps to try, in MiB (``math.inf``: one bucket).
      first_mb: the first bucket's cap, default 1 (clipped to each candidate);
        ``first_bucket_mb`` is its deprecated name.
      backward_s: the backward pass's compute time in seconds when ``model`` is not a profile.
      forward_s: the forward pass's compute time, likewise.
      optimizer_s: the optimizer update's compute time, likewise.
      tolerance: relative slack; the smallest cap within ``(1 + tolerance)`` of the best
        prediction is chosen.

    Returns:
      The advice, with every candidate's prediction (``advice.table()`` shows them).
    """
    first = options.renamed_args("advise_bucket_cap", {"first_mb": first_mb}, renamed,
                                 {"first_bucket_mb": "first_mb"})["first_mb"]
    first = 1.0 if first is None else first
    profile = _as_profile(
        model, backward_s=backward_s, forward_s=forward_s, optimizer_s=optimizer_s
    )
    caps = [float(c) for c in candidates_mb]
    if not caps:
        raise ValueError("candidates_mb is empty.")
    preds = tuple(
        (c, simulate_iteration(profile, cluster, cap_mb=c, first_mb=min(first, c)))
        for c in caps
    )
    best = min(est.iteration_s for _, est in preds)
    # Ties (within tolerance) go to the smallest cap: less staging memory, earlier first start.
    chosen = min(c for c, est in preds if est.iteration_s <= best * (1.0 + tolerance))
    return CapAdvice(chosen, preds, cluster)


def suggest_bucket_cap(
    params_or_leaf_sizes: Any,
    cluster: ClusterSpec,
    **kwargs: Any,
) -> float:
    """The bucket cap (MiB) with the lowest predicted iteration time for a model on a cluster.

    A thin wrapper over :func:`advise_bucket_cap` (same arguments), which also returns every
    candidate's prediction so the choice can be explained::

        from jddp.perf import costmodel

        cluster = costmodel.ClusterSpec(64, inter=costmodel.Link.gbit(100, 10))
        cap = costmodel.suggest_bucket_cap(profile, cluster)
        print(costmodel.advise_bucket_cap(profile, cluster).table())

    Returns:
      One of the candidate caps, in MiB (``math.inf`` means a single bucket).
    """
    return advise_bucket_cap(params_or_leaf_sizes, cluster, **kwargs).cap_mb
