"""What owner sharding moves, as its plan states it (``print(ddp.report(state, batch))``).

:func:`routes` computes from the shapes and the bucket plan each bucket's route to the owners and
the operand bytes of the collectives that move gradients and updates (docs/sharded.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jddp._src.core import owner_rows, zero
from jddp._src.core.bytemodel import fmt_bytes, pack_bytes
from jddp._src.core.collectives import wire_platform
from jddp._src.place import owner
from jddp._src.plan.planner import BucketPlan
from jddp._src.tree import key_path_str

BALANCED, STRADDLING, EVEN = "balanced", "straddling", "even pieces"


class Route(NamedTuple):
    """How one bucket's gradients reach their owners (stages 2-3).

    Attributes:
      bucket: the bucket's index (reduction order).
      leaves: its split leaves (those reduce-scattered).
      owners: the distinct owners of those leaves.
      kind: ``BALANCED`` (every row of the reduce-scatter is exactly its owner's leaves: nothing
        moves after it), ``STRADDLING`` (owner rows; segments of an owner with more than an
        even share lie in other rows and go to it by an all-to-all) or ``EVEN`` (owner rows
        would send more, typically fewer leaves than devices: the even pieces go to the owners
        by an all-to-all).
      away: elements of the bucket that lie, after the reduce-scatter, outside their owner's
        row (summed over the devices).
    """

    bucket: int
    leaves: int
    owners: int
    kind: str
    away: int


class Routes(NamedTuple):
    """The owner update's data movement for one model, bucket plan and stage.

    Attributes:
      buckets: per bucket its :class:`Route` (empty below stage 2: the gradients are
        all-reduced whole, every owner has its own).
      grads_bytes: operand bytes per step of the all-to-alls that carry gradients to their
        owners after the reduce-scatters (straddling segments and even pieces, leaves in no
        bucket included); when some owner reads every gradient (a global norm) the rows are
        all-gathered instead, the even all-gather's bytes.
      updates_bytes: operand bytes per step of the updates' way back: stage 3's all-to-all of
        the owners' pieces to the even pieces, or stages 1-2's all-gather of each owner's row
        of whole leaves (as wide as the busiest owner's).
      even_updates_bytes: the same for even ZeRO at this stage: none at stage 3 (each device
        updates its own pieces), the all-gather of the even pieces at stages 1-2.
      pieces: whether the parameters are stored in pieces (stage 3).
      whole_bytes: at stage 3, operand bytes of the all-gather of the owners' updates of the
        leaves kept whole (too small or odd to split).
    """

    buckets: tuple[Route, ...]
    grads_bytes: int
    updates_bytes: int
    even_updates_bytes: int
    pieces: bool
    whole_bytes: int = 0

    def describe(self) -> str:
        """Lines for the report: each bucket's route, then what the update moves."""
        lines = []
        for r in self.buckets:
            # Each entry on two lines: the report stays readable in an 80-column terminal.
            what = {BALANCED: "owner rows, each row exactly its owner's leaves:\n  nothing moves "
                              "after the reduce-scatter",
                    STRADDLING: f"owner rows;\n  {r.away:,} elements lie in other owners' rows "
                                "and go to their owner by an all-to-all",
                    EVEN: f"even pieces (owner rows would send more);\n  {r.away:,} elements "
                          "go to their owners by an all-to-all"}[r.kind]
            lines.append(f"bucket {r.bucket} ({r.leaves} split leaves, {r.owners} owners): "
                         f"{what}")
        if self.buckets:
            lines.append(f"gradients to owners after the reduce-scatters: "
                         f"{fmt_bytes(self.grads_bytes)} per step in all-to-alls\n  (with a "
                         "global norm: every row all-gathered instead)")
        else:
            lines.append("gradients: all-reduced whole, every owner has its own")
        if self.pieces:
            lines.append(f"updates back to the even pieces: {fmt_bytes(self.updates_bytes)} "
                         "per step in an all-to-all"
                         + (f",\n  and the leaves kept whole all-gathered "
                            f"({fmt_bytes(self.whole_bytes)})" if self.whole_bytes else "")
                         + " (even ZeRO: none)")
        else:
            lines.append(f"updates to every device: all-gathers of "
                         f"{fmt_bytes(self.updates_bytes)} per step,\n  each owner's row "
                         f"(even ZeRO: {fmt_bytes(self.even_updates_bytes)})")
        return "\n".join(lines)


def _route(b: int, rows: owner_rows.BucketRows, kept: bool, owners: Sequence[int],
           layout: zero.Layout) -> Route:
    split = rows.split
    who = len({owners[i] for i in split})
    if kept:
        away = sum(int(np.prod(layout.shapes[i])) * (layout.n - 1) // layout.n for i in split)
        return Route(b, len(split), who, EVEN, away)
    away = sum(p.size for p in rows.parts if p.row != owners[p.leaf])
    return Route(b, len(split), who, STRADDLING if away else BALANCED, away)


def routes(params: Any, owners: Sequence[int], n: int, plan: BucketPlan | None,
           pieces: tuple[bool, bool]) -> Routes:
    """The :class:`Routes` of ``params`` (arrays or shape structs) with leaf owners ``owners``
    on ``n`` devices; ``plan``: the step's bucket plan (``None``: not traced yet, no bucket
    routes); ``pieces``: whether the parameters and the gradients are stored in pieces."""
    layout = zero.Layout.of(params, n)
    moved = owner.packs(pieces, n, layout, plan, params, params)
    wire = wire_platform()

    def size(pack: Any, rows: int) -> int:
        return pack_bytes(pack.groups, pack.width, rows, wire)

    buckets: list[Route] = []
    grads = 0
    if pieces[1] and plan is not None:
        ex = moved.rows
        assert ex is not None  # gradients in pieces with a plan: owner rows
        for b, bucket in enumerate(plan.buckets):
            full = owner_rows.bucket_rows(bucket.indices, layout, owners)
            if full.split:
                buckets.append(_route(b, full, not ex.rows[b].split, owners, layout))
        # The straddling segments' all-to-all and the leaves in no bucket, as even pieces.
        grads = size(ex, n) + size(moved.grads.send, n)
    if pieces[0]:
        return Routes(tuple(buckets), grads, size(moved.params.send, n), 0, True,
                      size(moved.params.whole, 1))
    even: dict[Any, int] = {}
    for i, d in enumerate(layout.dims):
        if d is not None:
            dt = jnp.dtype(jnp.result_type(jax.tree.leaves(params)[i]))
            even[dt] = even.get(dt, 0) + int(np.prod(layout.shapes[i])) // n
    return Routes(tuple(buckets), grads, size(moved.params.whole, 1),
                  pack_bytes(list(even), list(even.values()), 1, wire), False)


class OwnerPlan(NamedTuple):
    """The owners of a model's leaves, by path, and what moves (what ``ddp.report`` shows).

    Attributes:
      routes: how the gradients reach their owners and the updates come back
        (:class:`Routes`), ``None`` when not given.
    """

    paths: tuple[str, ...]
    owners: owner.Owners
    shapes: tuple[tuple[int, ...], ...] = ()
    routes: Routes | None = None

    def by_path(self) -> dict[str, int]:
        """``{leaf path: owner device}``."""
        return dict(zip(self.paths, self.owners.owner, strict=True))

    def __str__(self) -> str:
        text = self.owners.describe(self.paths, self.shapes)
        return text if self.routes is None else text + "\n" + self.routes.describe()


def plan(params: Any, n: int, buckets: BucketPlan | None = None,
         pieces: tuple[bool, bool] | None = None) -> OwnerPlan:
    """:func:`jddp._src.place.owner.assign` over the leaves of ``params`` (arrays or shape
    structs) on ``n`` devices, with the :func:`routes` of the step's bucket plan ``buckets``
    when ``pieces`` (whether parameters and gradients are stored in pieces) is given."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    shapes = tuple(tuple(np.shape(x)) for _, x in leaves)
    owners = owner.assign(shapes, n)
    moves = None if pieces is None else routes(params, owners.owner, n, buckets, pieces)
    return OwnerPlan(tuple(key_path_str(p) for p, _ in leaves), owners, shapes, moves)
