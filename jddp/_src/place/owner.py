"""Owner-sharded placement (``jddp.ZeRO(stage=s, shard="owner")``): each leaf's update on one device.

Parameters and gradients are stored as at ``ZeRO(stage=s)``, the optimizer state per owner
(:mod:`jddp._src.place.owner_state`); each device runs the optimizer in its branch of a
``lax.switch`` whose outputs are its own leaves, and the updates go back where the leaves are
stored. docs/sharded.md ("Whole-matrix optimizers") describes each step.
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

from jddp._src.core import recorder, zero
from jddp._src.place import owner_grads, owner_state
from jddp._src.plan.planner import BucketPlan
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

    def describe(self, paths: Sequence[str], shapes: Sequence[Shape] = ()) -> str:
        """A summary (leaves, matrices among ``shapes``, the busiest device's share of the
        update's cost, the devices that update nothing), then one line per device: its leaves
        and its share."""
        total = sum(self.cost) or 1.0
        n = len(self.load)
        matrices = (f" ({sum(1 for s in shapes if len(s) >= 2)} matrices)" if shapes else "")
        idle = [d for d in range(n) if d not in self.owner]
        lines = [f"{len(self.owner)} leaves{matrices} on {n} devices"
                 + (f"; devices {', '.join(map(str, idle))} update nothing" if idle else ""),
                 f"the busiest device runs {100 * max(self.load, default=0) / total:.1f}% of "
                 f"the update, {self.imbalance():.2f}x an even share ({100 / max(n, 1):.1f}%)"]
        for d, load in enumerate(self.load):
            names = [paths[i] for i, o in enumerate(self.owner) if o == d]
            lines.append(f"device {d}: {100 * load / total:5.1f}% of the update "
                         f"({len(names)} leaves: {', '.join(names) or '-'})")
        if self.too_large:
            listed = ", ".join(paths[i] for i in self.too_large)
            lines.append(f"too large to balance (each alone more than 1/{n} of the update): "
                         f"{listed}")
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


def state_owners(params: Any, opt_state: Any, owners: Owners,
                 rest: int | None = 0) -> tuple[int | None, ...]:
    """The owner of each optimizer-state leaf: that of the parameter leaf it is the slot of (its
    tree path ends with the parameter's path: optax's ``mu``, ``nu``, GaLore's projectors, ...),
    ``rest`` for the others (counts, coefficients: every device keeps them, ``None``)."""
    by_path = {tuple(path): i for i, (path, _) in
               enumerate(jax.tree_util.tree_leaves_with_path(params))}
    out: list[int | None] = []
    for path, _ in jax.tree_util.tree_leaves_with_path(opt_state):
        path, found = tuple(path), rest
        for start in range(len(path)):  # the longest matching suffix first
            hit = by_path.get(path[start:])
            if hit is not None:
                found = owners.owner[hit]
                break
        out.append(found)
    return tuple(out)


def init_state(optimizer: optax.GradientTransformation, params: Any,
               n: int) -> owner_state.Packed:
    """The optimizer's initial state of ``params``, packed per owner on ``n`` devices: each slot
    of a parameter on that parameter's owner, the rest on every device."""
    opt_state = optimizer.init(params)
    owners = assign([tuple(np.shape(x)) for x in jax.tree.leaves(params)], n)
    return owner_state.pack(opt_state, owner_state.make_layout(
        opt_state, state_owners(params, opt_state, owners, None), n))


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
    def size(lf: _Leaf) -> int:
        whole = int(np.prod(lf.shape, dtype=np.int64))
        return whole // n if piece and lf.dim is not None else whole

    return _Pack(*owner_state.offsets(
        ((i, jnp.dtype(leaves[i].dtype), size(leaves[i]), leaves[i].owner) for i in indices), n))


def _rows(pack: _Pack, parts: dict[int, jax.Array], rows: int) -> list[jax.Array]:
    """Buffers ``(rows, width)`` per dtype holding one owner's ``parts`` (each ``(rows, size)``)
    at their offsets, zeros elsewhere."""
    return [owner_state.fill_row(pack.groups, pack.width, pack.where, parts, g, rows)
            for g in range(len(pack.groups))]


# ------------------------------------------------------------------------------ the update


class Needs(NamedTuple):
    """What the owners' updates read beyond their own leaves (:func:`analyse`)."""

    all_grads: bool  # some owner reads another owner's gradient (a global norm)
    params: bool     # some owner reads its own parameters (weight decay, trust ratios)
    common_local: bool = False  # the common state leaves read only what every device holds


def analyse(optimizer: optax.GradientTransformation, params: Any, opt_state: Any, grads: Any,
            param_owner: Sequence[int], state_owner: Sequence[int],
            split_params: Sequence[bool], split_state: Sequence[bool],
            paths: Sequence[str], common: Sequence[bool] = ()) -> Needs:
    """Which inputs each owner's update reads, from the optimizer traced once and pruned to each
    owner's outputs (its updates and new state). Refuses, naming the leaf, an optimizer whose
    update of a leaf reads another owner's parameters or optimizer state (those live in pieces
    elsewhere and read as zeros on the owner).

    Args:
      common: per state leaf, whether every device keeps it (then counted as device 0's above,
        and ``Needs.common_local`` says whether every device can compute it alike).
    """
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
    local = False
    if any(common):
        _, used = pe.dce_jaxpr(closed.jaxpr, [False] * np_ + list(common))
        local = not any(u and split_in[j] and not (j < ng and all_grads)
                        for j, u in enumerate(used))
    return Needs(all_grads, params_read, local)


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
        for g, b in enumerate(_rows(io.send, parts, 1)):
            bufs[g].append(b)
    return [recorder.all_to_all(jnp.concatenate(b, axis=0), axis, 0, 0, tiled=True)
            for b in bufs]


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
    return _rows(io.send, split, n), _rows(io.whole, whole, 1)


def _from_owners(io: _Io, split_bufs: list, whole_bufs: list, n: int, axis: Any) -> list:
    """Every device's pieces (and whole leaves) of the owners' new values."""
    got = [recorder.all_to_all(b, axis, 0, 0, tiled=True) for b in split_bufs]
    rows = [recorder.gather_rows(b, axis) for b in whole_bufs]
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


class Packs(NamedTuple):
    """The static buffers of the parameters and gradients :func:`update` moves (from the
    shapes alone: the optimizer decides only which of them it reads)."""

    params: _Io
    grads: _Io
    rows: owner_grads.Exchange | None  # the gradients' owner rows (from stage 2), else None
    dims: tuple[tuple[int | None, ...], ...]  # as stored: parameters, gradients


class _Moves(NamedTuple):
    """What :func:`update` moves for one model and optimizer (static: from the shapes)."""

    io: Packs
    state: owner_state.StateLayout
    common: tuple[_Leaf, ...]  # the state leaves every device keeps (device 0 computes them)
    common_pack: _Pack         # their new values, from device 0 to every device
    needs: Needs


def packs(pieces: tuple[bool, bool], n: int, layout: zero.Layout, plan: BucketPlan | None,
          params: Any, grads: Any) -> Packs:
    """:class:`Packs` for ``pieces`` (whether parameters and gradients are stored in pieces);
    ``plan=None``: no owner rows (the gradients' buffers then leave out none)."""
    owners = assign(layout.shapes, n).owner
    p_dims = layout.dims if pieces[0] else (None,) * len(layout.dims)
    g_dims = layout.dims if pieces[1] else (None,) * len(layout.dims)
    # From stage 2 the buckets' split leaves come in owner rows (the reducer's); the others
    # (in no bucket: JAX-reduced or unused) as even pieces, sent to their owners as before.
    rows = (owner_grads.exchange(plan, layout, owners,
                                 [jnp.result_type(g) for g in jax.tree.leaves(grads)])
            if pieces[1] and plan is not None else None)
    skip = frozenset() if rows is None or plan is None else rows.ranked() | frozenset(plan.unused)
    loose = tuple(None if i in skip else d for i, d in enumerate(g_dims))
    return Packs(_io(_leaves(params, owners, p_dims), n), _io(_leaves(grads, owners, loose), n),
                 rows, (tuple(p_dims), tuple(g_dims)))


def _moves(pieces: tuple[bool, bool], optimizer: optax.GradientTransformation, n: int,
           layout: zero.Layout, plan: BucketPlan, params: Any, opt_state: owner_state.Packed,
           grads: Any) -> _Moves:
    static = packs(pieces, n, layout, plan, params, grads)
    lay = opt_state.layout
    abstract = jax.tree.unflatten(lay.treedef, [jax.ShapeDtypeStruct(sh, jnp.dtype(dt)) for sh, dt
                                                in zip(lay.shapes, lay.dtypes, strict=True)])
    needs = analyse(optimizer, params, abstract, grads, [lf.owner for lf in static.params.leaves],
                    [0 if o is None else o for o in lay.owner],
                    [d is not None for d in static.dims[0]], [o is not None for o in lay.owner],
                    plan.paths, [o is None for o in lay.owner])
    common = tuple(_Leaf(lay.shapes[i], jnp.dtype(lay.dtypes[i]), None, 0) for i in lay.common())
    return _Moves(static, lay, common, _pack(common, range(len(common)), n, False), needs)


def _state_inputs(moves: _Moves, k: int, rows: list, common: list) -> Any:
    """The optax state a branch's optimizer reads: device ``k``'s owned leaves from its rows,
    the common leaves from its copy, zeros for the leaves other devices own."""
    lay = moves.state
    owned = owner_state.owned_leaves(lay, k, rows)
    mine = dict(zip(lay.common(), common, strict=True))
    return jax.tree.unflatten(lay.treedef, [
        owned[i] if i in owned else mine[i][0] if i in mine
        else jnp.zeros(lay.shapes[i], lay.dtypes[i]) for i in range(len(lay.shapes))])


def _state_outputs(moves: _Moves, k: int, new: list) -> tuple[list, list]:
    """Owner ``k``'s new state: its ``(1, width)`` rows per dtype, and the common leaves: its
    own copies when every device computes them alike, else device 0's as ``(1, width)`` rows
    per dtype (all-gathered by :func:`_common_from_zero`)."""
    lay = moves.state
    mine = {i: jnp.reshape(new[i], (1, -1)) for i in lay.owned(k)}
    rows = [owner_state.fill_row(lay.groups, lay.width, lay.where, mine, g)
            for g in range(len(lay.groups))]
    if moves.needs.common_local:  # every device computed them alike: its own copy
        return rows, [jnp.reshape(new[i], (1, *lay.shapes[i])) for i in lay.common()]
    parts = {j: jnp.reshape(new[i], (1, -1)) for j, i in enumerate(lay.common())} if k == 0 else {}
    return rows, _rows(moves.common_pack, parts, 1)


def _common_from_zero(moves: _Moves, bufs: list, axis: Any) -> list:
    """Every device's copy (``(1, *shape)``) of device 0's new common state leaves (computed
    alike on every device: its own)."""
    if moves.needs.common_local:
        return bufs
    got = [recorder.gather_rows(b, axis) for b in bufs]
    out = []
    for j, lf in enumerate(moves.common):
        g, off, size = moves.common_pack.where[j]
        out.append(jnp.reshape(got[g][0, off:off + size], (1, *lf.shape)))
    return out


def update(pieces: tuple[bool, bool], optimizer: optax.GradientTransformation, topo: Topology,
           layout: zero.Layout, plan: BucketPlan, params: Any, opt_state: owner_state.Packed,
           grads: Any, record: Any = None) -> tuple[Any, owner_state.Packed]:
    """``(new_params, new_opt_state)``: each leaf's update computed on its owner, applied where
    the leaf is stored (global view; the optimizer state packed per owner: :func:`init_state`).

    Args:
      pieces: whether the parameters and the gradients are stored in pieces.
      record: called, when traced, with the :class:`Bytes` one device sends here (for
        ``metrics["comm_bytes"]``); ``None``: not counted.
    """
    n, axis = topo.shard_count, topo.shard
    moves = _moves(pieces, optimizer, n, layout, plan, params, opt_state, grads)
    pio, gio, needs = moves.io.params, moves.io.grads, moves.needs
    p_tree = jax.tree.structure(params)
    p_specs, g_specs = ([P() if d is None else P(*([None] * d), axis) for d in dims]
                        for dims in moves.io.dims)
    rows_spec = [P(axis)] * len(opt_state.rows)
    common_spec = [P(axis)] * len(opt_state.common)

    def local(p: list, rows: list, common: list, g: list) -> tuple[list, list, list]:
        g_rows = owner_grads.my_rows(moves.io.rows, g) if moves.io.rows is not None else []
        g_in = owner_grads.all_whole(moves.io.rows, _gather_whole(g, gio.leaves, axis), g_rows,
                                     axis, gio.leaves, moves.io.dims[1]) if needs.all_grads else g
        g_got = [] if needs.all_grads else [
            _to_owners(gio, g, n, axis),
            owner_grads.send(moves.io.rows, g_rows, n, axis) if moves.io.rows is not None else []]
        p_got = _to_owners(pio, p, n, axis) if needs.params else []

        def branch(k: int) -> Any:
            def run(p_got: list, g_got: list, g_in: list, p: list, rows: list,
                    common: list) -> Any:
                own_p = _owned_whole(pio, p_got, k) if needs.params else {}
                pp = jax.tree.unflatten(p_tree, _branch_inputs(pio, p, own_p))
                gg = g_in[0] if needs.all_grads else owner_grads.branch_whole(
                    moves.io.rows, k, g_in[0], g_in[1], g_got[1], _owned_whole(gio, g_got[0], k),
                    gio.leaves, moves.io.dims[1])
                updates, new_s = optimizer.update(jax.tree.unflatten(p_tree, gg),
                                                  _state_inputs(moves, k, rows, common), pp)
                return (_branch_outputs(pio, jax.tree.leaves(updates), k, n),
                        _state_outputs(moves, k, jax.tree.leaves(new_s)))
            return run

        (us, uw), (new_rows, common_bufs) = lax.switch(
            lax.axis_index(axis), [branch(k) for k in range(n)], p_got, g_got,
            [g_in, g_rows], p, rows, common)
        return (_apply(plan, p, _from_owners(pio, us, uw, n, axis)), new_rows,
                _common_from_zero(moves, common_bufs, axis))

    with recorder.recording(topo.axes.hosts) as rec:
        new_p, new_rows, new_common = jax.shard_map(
            local, mesh=topo.mesh, in_specs=(p_specs, rows_spec, common_spec, g_specs),
            out_specs=(p_specs, rows_spec, common_spec), check_vma=False,
        )(jax.tree.leaves(params), list(opt_state.rows), list(opt_state.common),
          jax.tree.leaves(grads))
    if record is not None:
        record(rec.sent)
    return (jax.tree.unflatten(p_tree, new_p),
            owner_state.Packed(new_rows, new_common, opt_state.layout))
