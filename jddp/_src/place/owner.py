"""Owner-sharded placement (``jddp.ZeRO(stage=s, shard="owner")``): each leaf's update on one device.

Whole-matrix optimizers (Muon's Newton–Schulz orthogonalization, Shampoo-like preconditioners)
need a leaf whole to update it. Split evenly (``shard="even"``), XLA partitions that work across
the shards and communicates in every iteration; replicated, every device repeats all of it. Here
each parameter leaf has one **owner** device (:func:`assign`: greedy bin packing of the update's
cost, largest first), and only the owner computes the leaf's update:

- the parameters, gradients and optimizer state are *stored* as at ``ZeRO(stage=s)`` (the same
  specs, checkpoints, forward gathers and reductions: :class:`jddp._src.place.placement.ZeRO`'s);
- the update (:func:`update`) runs in one ``shard_map``: the optimizer state's pieces go to each
  leaf's owner (one all-to-all per dtype); so do the reduced gradients' pieces (from stage 2),
  unless some owner's update reads another's gradient (``clip_by_global_norm``): then they are
  all-gathered, and global norms see every leaf exactly; at stage 3 the parameters' pieces go
  to the owners only if the optimizer reads parameters (weight decay);
- every device then runs the optimizer in one branch of a ``lax.switch`` on its own index, whose
  outputs are the leaves it owns only: XLA removes the rest of the update from that branch, so the
  orthogonalization of each matrix runs once, on its owner, and no collective runs inside it;
- the owners' updates and new state go back to the pieces (one all-to-all per dtype) and, for
  leaves stored whole (stages 1-2's parameters, scalars), to every device (one all-gather per
  dtype); each device adds the updates to the parameters it stores;
- the bytes those collectives send (:func:`sent`, for ``metrics["comm_bytes"]``) are counted from
  the buffers :func:`update` builds, when it is traced: they depend on the optimizer state.

Inputs that live in pieces and belong to another owner read as zeros on a device: :func:`analyse`
traces the optimizer once and refuses, naming the leaf, an optimizer whose update of one leaf
reads the parameters or optimizer state of another (never the case in optax: its global
quantities are gradient norms).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import ClosedJaxpr
from jax.interpreters import partial_eval as pe
from jax.sharding import PartitionSpec as P

from jddp._src.introspect import vma
from jddp._src.place import zero
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.bytemodel import Bytes, ring
from jddp._src.reduce.collectives import wire_itemsize
from jddp._src.runtime.topology import Topology
from jddp._src.tree import key_path_str

Shape = Sequence[int]


# ------------------------------------------------------------------------------ the assignment


def update_cost(shape: Shape) -> float:
    """The cost of one leaf's update as the bin packing weighs it: for a matrix (the last two
    dimensions; leading ones are a batch of matrices) Newton–Schulz's ``m * n * min(m, n)``
    multiply-adds, for anything else its element count."""
    if len(shape) < 2:
        return float(np.prod(shape, dtype=np.float64))
    m, n = shape[-2], shape[-1]
    batch = float(np.prod(shape[:-2], dtype=np.float64))
    return batch * m * n * min(m, n)


class Owners(NamedTuple):
    """Which device updates each parameter leaf (``jax.tree.leaves`` order).

    Attributes:
      owner: per leaf, the index of its owner along the shard axis.
      cost: per leaf, :func:`update_cost` of its shape.
      load: per device, the sum of the costs it owns.
      too_large: leaves whose cost alone exceeds an even share (``sum(cost) / n``): their owner
        carries more than its share whatever the packing; the plan names them.
    """

    owner: tuple[int, ...]
    cost: tuple[float, ...]
    load: tuple[float, ...]
    too_large: tuple[int, ...]

    def imbalance(self) -> float:
        """The busiest device's load over the mean load (1.0: perfectly balanced)."""
        mean = sum(self.load) / max(len(self.load), 1)
        return max(self.load) / mean if mean > 0 else 1.0

    def describe(self, paths: Sequence[str]) -> str:
        """One line per device: its leaves and its share of the update's cost."""
        total = sum(self.cost) or 1.0
        lines = []
        for d, load in enumerate(self.load):
            names = [paths[i] for i, o in enumerate(self.owner) if o == d]
            lines.append(f"device {d}: {100 * load / total:5.1f}% of the update "
                         f"({len(names)} leaves: {', '.join(names) or '-'})")
        if self.too_large:
            n = len(self.load)
            listed = ", ".join(paths[i] for i in self.too_large)
            lines.append(f"too large to balance (each alone more than 1/{n} of the update): "
                         f"{listed}; the busiest device runs "
                         f"{100 * max(self.load) / total:.1f}% of the update, an even share "
                         f"{100 / n:.1f}%")
        return "\n".join(lines)


def assign(shapes: Sequence[Shape], n: int) -> Owners:
    """Greedy bin packing of the leaves' :func:`update_cost` over ``n`` devices: largest first,
    each to the least loaded device (ties: the lower leaf index first, the lower device)."""
    costs = tuple(update_cost(s) for s in shapes)
    load = [0.0] * n
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        d = min(range(n), key=lambda d: (load[d], d))
        owner[i] = d
        load[d] += costs[i]
    share = sum(costs) / n
    too_large = tuple(i for i, c in enumerate(costs) if n > 1 and c > share and c > 0)
    return Owners(tuple(owner), costs, tuple(load), too_large)


class OwnerPlan(NamedTuple):
    """The owners of a model's leaves, by path (what ``ddp.report`` shows)."""

    paths: tuple[str, ...]
    owners: Owners

    def by_path(self) -> dict[str, int]:
        """``{leaf path: owner device}``."""
        return dict(zip(self.paths, self.owners.owner, strict=True))

    def __str__(self) -> str:
        return self.owners.describe(self.paths)


def plan(params: Any, n: int) -> OwnerPlan:
    """:func:`assign` over the leaves of ``params`` (arrays or shape structs) on ``n`` devices."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return OwnerPlan(tuple(key_path_str(p) for p, _ in leaves),
                     assign([tuple(np.shape(x)) for _, x in leaves], n))


def state_owners(params: Any, opt_state: Any, owners: Owners) -> tuple[int, ...]:
    """The owner of each optimizer-state leaf: that of the parameter leaf it is the slot of (its
    tree path ends with the parameter's path: optax's ``mu``, ``nu``, GaLore's projectors, ...),
    device 0 for the rest (counts, coefficients; every device computes them)."""
    by_path = {tuple(path): i for i, (path, _) in
               enumerate(jax.tree_util.tree_leaves_with_path(params))}
    out = []
    for path, _ in jax.tree_util.tree_leaves_with_path(opt_state):
        path, found = tuple(path), 0
        for start in range(len(path)):  # the longest matching suffix first
            hit = by_path.get(path[start:])
            if hit is not None:
                found = owners.owner[hit]
                break
        out.append(found)
    return tuple(out)


# ------------------------------------------------------------------------------ packing


class _Leaf(NamedTuple):
    shape: tuple[int, ...]
    dtype: Any
    dim: int | None   # the split dimension as stored (None: whole on every device)
    owner: int


class _Pack(NamedTuple):
    """Static row layout of some leaves packed per owner, one buffer per dtype.

    ``where[i] = (group, offset, size)``; ``width[group]`` is the padded row length."""

    groups: tuple[Any, ...]
    width: tuple[int, ...]
    where: dict[int, tuple[int, int, int]]


def _pack(leaves: Sequence[_Leaf], indices: Sequence[int], n: int, piece: bool) -> _Pack:
    groups: list[Any] = []
    fill: dict[tuple[int, int], int] = {}
    where = {}
    for i in indices:
        lf = leaves[i]
        dt = jnp.dtype(lf.dtype)
        if dt not in groups:
            groups.append(dt)
        g = groups.index(dt)
        size = int(np.prod(lf.shape, dtype=np.int64))
        size = size // n if piece and lf.dim is not None else size
        off = fill.get((g, lf.owner), 0)
        where[i] = (g, off, size)
        fill[(g, lf.owner)] = off + size
    width = tuple(max([fill.get((g, d), 0) for d in range(n)] + [1]) for g in range(len(groups)))
    return _Pack(tuple(groups), width, where)


def _rows(pack: _Pack, k: int, leaves: Sequence[_Leaf], parts: dict[int, jax.Array],
          rows: int) -> list[jax.Array]:
    """Buffers ``(rows, width)`` per dtype holding owner ``k``'s ``parts`` (each ``(rows, size)``)
    at their offsets, zeros elsewhere."""
    out = []
    for g, dt in enumerate(pack.groups):
        mine = [(pack.where[i][1], parts[i]) for i in sorted(parts)
                if pack.where[i][0] == g and leaves[i].owner == k]
        cols = [p.astype(dt) for _, p in sorted(mine, key=lambda t: t[0])]
        used = sum(c.shape[1] for c in cols)
        if used < pack.width[g]:
            cols.append(jnp.zeros((rows, pack.width[g] - used), dt))
        out.append(jnp.concatenate(cols, axis=1) if len(cols) > 1 else cols[0])
    return out


# ------------------------------------------------------------------------------ the update


class Needs(NamedTuple):
    """What the owners' updates read beyond their own leaves (:func:`analyse`)."""

    all_grads: bool  # some owner reads another owner's gradient (a global norm)
    params: bool     # some owner reads its own parameters (weight decay, trust ratios)


def analyse(optimizer: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any,
            param_owner: Sequence[int], state_owner: Sequence[int],
            split_params: Sequence[bool], split_state: Sequence[bool],
            paths: Sequence[str]) -> Needs:
    """Which inputs each owner's update reads, from the optimizer traced once and pruned to each
    owner's outputs (its updates and new state). Refuses, naming the leaf, an optimizer whose
    update of a leaf reads another owner's parameters or optimizer state (those live in pieces
    elsewhere and read as zeros on the owner)."""
    def run(g: Any, p: Any, s: Any) -> Any:
        updates, new_s = optimizer.update(g, s, p)
        return jax.tree.leaves(updates), jax.tree.leaves(new_s)

    closed: ClosedJaxpr = jax.make_jaxpr(run)(grads, params, opt_state)
    state_paths = [key_path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(opt_state)]
    ng, np_ = len(jax.tree.leaves(grads)), len(param_owner)
    owners_out = list(param_owner) + list(state_owner)
    owners_in = list(param_owner) + list(param_owner) + list(state_owner)
    split_in = [True] * ng + list(split_params) + list(split_state)
    all_grads = params_read = False
    for k in sorted(set(owners_out)):
        _, used = pe.dce_jaxpr(closed.jaxpr, [o == k for o in owners_out])
        for j, u in enumerate(used):
            if not u or not split_in[j]:
                continue
            if j < ng:
                all_grads |= owners_in[j] != k
            elif owners_in[j] == k:
                params_read |= j < ng + np_
            else:
                what = (f"parameter {paths[j - ng]}" if j < ng + np_ else
                        f"optimizer-state leaf {state_paths[j - ng - np_]}")
                raise ValueError(
                    f"ZeRO(shard='owner'): the optimizer's update of the leaves owned by device "
                    f"{k} reads the {what}, which another device owns (owner sharding gives "
                    "each device the gradients it needs, but only its own parameters and "
                    "optimizer state). Use ZeRO(shard='even') or jddp.Replicate() with this "
                    "optimizer.")
    return Needs(all_grads, params_read)


def _gather_whole(pieces: list, leaves: Sequence[_Leaf], axis: Any) -> list:
    """Every split leaf whole on every device: one all-gather per dtype."""
    out = list(pieces)
    by_dtype: dict[Any, list[int]] = {}
    for i, lf in enumerate(leaves):
        if lf.dim is not None:
            by_dtype.setdefault(jnp.dtype(lf.dtype), []).append(i)
    for idx in by_dtype.values():
        dims = [d for d in (leaves[i].dim for i in idx) if d is not None]
        whole = zero.all_gather([pieces[i] for i in idx], dims,
                                [leaves[i].shape for i in idx], axis)
        for i, w in zip(idx, whole, strict=True):
            out[i] = w
    return out


class _Io(NamedTuple):
    """One kind of input and output of the update (parameters or optimizer state)."""

    leaves: tuple[_Leaf, ...]
    send: _Pack   # split leaves, pieces per owner (to and from the owners)
    whole: _Pack  # leaves stored whole, owners' new values to every device


def _io(leaves: Sequence[_Leaf], n: int) -> _Io:
    split = [i for i, lf in enumerate(leaves) if lf.dim is not None]
    whole = [i for i, lf in enumerate(leaves) if lf.dim is None]
    return _Io(tuple(leaves), _pack(leaves, split, n, True), _pack(leaves, whole, n, False))


def _dim(leaf: _Leaf) -> int:
    assert leaf.dim is not None  # only split leaves are packed as pieces
    return leaf.dim


def _to_owners(io: _Io, pieces: list, n: int, axis: Any) -> list:
    """Each device's pieces of the split leaves sent to their owners: per dtype, an
    ``(n, width)`` all-to-all whose row ``s`` holds the pieces of the leaves ``s`` owns."""
    bufs: list[list[jax.Array]] = [[] for _ in io.send.groups]
    for s in range(n):
        parts = {i: zero.piece_row(pieces[i], _dim(io.leaves[i])) for i in io.send.where
                 if io.leaves[i].owner == s}
        for g, b in enumerate(_rows(io.send, s, io.leaves, parts, 1)):
            bufs[g].append(b)
    return [lax.all_to_all(jnp.concatenate(b, axis=0), axis, 0, 0, tiled=True) for b in bufs]


def _owned_whole(io: _Io, received: list, k: int) -> dict[int, jax.Array]:
    """On owner ``k``: its split leaves whole, from what :func:`_to_owners` brought."""
    out = {}
    for i, (g, off, size) in io.send.where.items():
        lf = io.leaves[i]
        if lf.owner == k:
            assert lf.dim is not None
            out[i] = zero.from_rows(received[g][:, off:off + size], lf.dim, lf.shape)
    return out


def _branch_inputs(io: _Io, stored: list, owned: dict[int, jax.Array]) -> list:
    """The full leaves a branch's optimizer reads: owned and whole leaves real, others zeros."""
    return [owned[i] if i in owned else stored[i] if lf.dim is None
            else jnp.zeros(lf.shape, lf.dtype) for i, lf in enumerate(io.leaves)]


def _branch_outputs(io: _Io, new: list, k: int, n: int) -> tuple[list, list]:
    """Owner ``k``'s new values packed: ``(n, width)`` pieces per destination for split leaves,
    ``(1, width)`` rows for whole leaves."""
    split = {i: zero.to_rows(new[i], io.leaves[i].dim, n) for i in io.send.where
             if io.leaves[i].owner == k}
    whole = {i: jnp.reshape(new[i], (1, -1)) for i in io.whole.where if io.leaves[i].owner == k}
    return _rows(io.send, k, io.leaves, split, n), _rows(io.whole, k, io.leaves, whole, 1)


def _from_owners(io: _Io, split_bufs: list, whole_bufs: list, n: int, axis: Any) -> list:
    """Every device's pieces (and whole leaves) of the owners' new values."""
    got = [lax.all_to_all(b, axis, 0, 0, tiled=True) for b in split_bufs]
    rows = [lax.all_gather(b, axis, axis=0, tiled=True) for b in whole_bufs]
    out = []
    for i, lf in enumerate(io.leaves):
        if lf.dim is not None:
            g, off, size = io.send.where[i]
            out.append(zero.from_row(got[g][lf.owner, off:off + size], lf.dim, lf.shape, n))
        else:
            g, off, size = io.whole.where[i]
            out.append(jnp.reshape(rows[g][lf.owner, off:off + size], lf.shape))
    return out


def _leaves(tree: Any, owners: Sequence[int], dims: Sequence[int | None]) -> tuple[_Leaf, ...]:
    return tuple(_Leaf(tuple(np.shape(x)), jnp.result_type(x), d, o)
                 for x, o, d in zip(jax.tree.leaves(tree), owners, dims, strict=True))


def _apply(plan: BucketPlan, params: list, updates: list) -> list:
    """``optax.apply_updates`` on this device's leaves (pieces or whole), the plan's unused
    leaves kept (as the even placement does: :func:`jddp._src.place.placement.keep_unused`)."""
    unused = frozenset(plan.unused)
    return [p if i in unused else jnp.asarray(p + u).astype(jnp.result_type(p))
            for i, (p, u) in enumerate(zip(params, updates, strict=True))]


class _Moves(NamedTuple):
    """What :func:`update` moves for one model and optimizer (static: from the shapes)."""

    params: _Io
    state: _Io
    grads: _Io
    needs: Needs
    dims: tuple[tuple[int | None, ...], ...]  # as stored: parameters, state, gradients


def _moves(stage: int, optimizer: optax.GradientTransformation, n: int, layout: zero.Layout,
           plan: BucketPlan, params: Any, opt_state: Any, grads: Any) -> _Moves:
    owners = assign(layout.shapes, n)
    p_dims = layout.dims if stage >= 3 else (None,) * len(layout.dims)
    g_dims = layout.dims if stage >= 2 else (None,) * len(layout.dims)
    s_owner = state_owners(params, opt_state, owners)
    s_dims = tuple(zero.shard_dim(np.shape(x), n) for x in jax.tree.leaves(opt_state))
    needs = analyse(optimizer, params, opt_state, grads, owners.owner, s_owner,
                    [d is not None for d in p_dims], [d is not None for d in s_dims], plan.paths)
    return _Moves(_io(_leaves(params, owners.owner, p_dims), n),
                  _io(_leaves(opt_state, s_owner, s_dims), n),
                  _io(_leaves(grads, owners.owner, g_dims), n), needs,
                  (tuple(p_dims), s_dims, tuple(g_dims)))


def _all_to_all(kind: str, nbytes: float, n: int, hosts: int) -> Bytes:
    """An all-to-all of ``nbytes`` per device over ``n`` devices on ``hosts`` hosts: not a ring,
    each device sends its ``1/n`` share straight to each of the others, ``n - n / hosts`` of
    them on other hosts (as :func:`jddp._src.plan.traffic.traffic` reads it)."""
    total = ring(kind, nbytes, n).total
    return Bytes(total, total * (n - n // hosts) / (n - 1) if hosts > 1 and n > 1 else 0.0)


def sent(moves: _Moves, n: int, hosts: int = 1) -> Bytes:
    """Bytes one device sends in :func:`update`'s collectives (the ring model), from the buffers
    it moves: per dtype, the all-to-alls of ``(n, width)`` rows to the owners and back, the
    all-gathers of the owners' ``(1, width)`` whole leaves, and (when some owner reads another's
    gradient) the all-gather of the gradients' pieces. ``hosts``: hosts the shard axis spans."""
    def each(kind: str, pack: _Pack, rows: int) -> Bytes:
        move = _all_to_all if kind == "all-to-all" else ring
        return sum((move(kind, rows * w * wire_itemsize(dt), n, hosts)
                    for dt, w in zip(pack.groups, pack.width, strict=True)), Bytes())

    out = Bytes()
    if moves.needs.all_grads:  # _gather_whole: one all-gather of the pieces per dtype
        pieces: dict[Any, int] = {}
        for i in moves.grads.send.where:
            lf = moves.grads.leaves[i]
            dt = jnp.dtype(lf.dtype)
            pieces[dt] = pieces.get(dt, 0) + moves.grads.send.where[i][2]
        for dt, size in pieces.items():
            out = out + ring("all-gather", size * wire_itemsize(dt), n, hosts)
    else:
        out = out + each("all-to-all", moves.grads.send, n)
    if moves.needs.params:
        out = out + each("all-to-all", moves.params.send, n)
    for io in (moves.params, moves.state):  # the state to its owners; both back from them
        out = out + each("all-to-all", io.send, n) + each("all-gather", io.whole, 1)
    return out + each("all-to-all", moves.state.send, n)


def update(stage: int, optimizer: optax.GradientTransformation, topo: Topology,
           layout: zero.Layout, plan: BucketPlan, params: Any, opt_state: Any,
           grads: Any, record: Any = None) -> tuple[Any, Any]:
    """``(new_params, new_opt_state)``: each leaf's update computed on its owner, applied where
    the leaf is stored (global view in and out, stored as at ``ZeRO(stage=stage)``).

    Gradients in pieces (from stage 2) go to their owners by an all-to-all, or are all-gathered
    when some owner reads another's gradient (a global norm); parameters in pieces (stage 3) go
    to their owners only when the optimizer reads them (:func:`analyse`).

    Args:
      record: called, when traced, with the :class:`Bytes` one device sends here (:func:`sent`;
        for ``metrics["comm_bytes"]``); ``None``: not counted.
    """
    n, axis = topo.shard_count, topo.shard
    moves = _moves(stage, optimizer, n, layout, plan, params, opt_state, grads)
    pio, sio, gio, needs = moves.params, moves.state, moves.grads, moves.needs
    if record is not None:
        record(sent(moves, n, _hosts(topo)))
    p_tree, s_tree = jax.tree.structure(params), jax.tree.structure(opt_state)
    p_specs, s_specs, g_specs = ([P() if d is None else P(*([None] * d), axis) for d in dims]
                                 for dims in moves.dims)

    def local(p: list, s: list, g: list) -> tuple[list, list]:
        g_in = _gather_whole(g, gio.leaves, axis) if needs.all_grads else g
        g_got = [] if needs.all_grads else _to_owners(gio, g, n, axis)
        p_got = _to_owners(pio, p, n, axis) if needs.params else []
        s_got = _to_owners(sio, s, n, axis)

        def branch(k: int) -> Any:
            def run(p_got: list, s_got: list, g_got: list, g_in: list, p: list, s: list) -> Any:
                own_p = _owned_whole(pio, p_got, k) if needs.params else {}
                pp = jax.tree.unflatten(p_tree, _branch_inputs(pio, p, own_p))
                ss = jax.tree.unflatten(s_tree, _branch_inputs(sio, s, _owned_whole(sio, s_got, k)))
                gg = g_in if needs.all_grads else _branch_inputs(gio, g, _owned_whole(gio, g_got, k))
                updates, new_s = optimizer.update(jax.tree.unflatten(p_tree, gg), ss, pp)
                return (_branch_outputs(pio, jax.tree.leaves(updates), k, n),
                        _branch_outputs(sio, jax.tree.leaves(new_s), k, n))
            return run

        (us, uw), (ss, sw) = lax.switch(lax.axis_index(axis), [branch(k) for k in range(n)],
                                        p_got, s_got, g_got, g_in, p, s)
        return _apply(plan, p, _from_owners(pio, us, uw, n, axis)), \
            _from_owners(sio, ss, sw, n, axis)

    new_p, new_s = jax.shard_map(
        local, mesh=topo.mesh, in_specs=(p_specs, s_specs, g_specs),
        out_specs=(p_specs, s_specs), check_vma=False,
    )(jax.tree.leaves(params), jax.tree.leaves(opt_state), jax.tree.leaves(grads))
    return jax.tree.unflatten(p_tree, new_p), jax.tree.unflatten(s_tree, new_s)


def _hosts(topo: Topology) -> int:
    """Hosts the shard axis spans (1 on one host, or sharding inside each host)."""
    h = topo.axes.hosts
    return int(topo.mesh.shape[h]) if h is not None and h in vma.axis_names(topo.shard) else 1
