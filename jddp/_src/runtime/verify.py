"""Consistent replicas: the same start on every process, and a check that replicas stayed equal.

:func:`sync_from_process0` is DDP's construction-time broadcast (after
:func:`check_same_structure`); :func:`verify_replicas` names the leaves that diverged;
:func:`fingerprint_replicas` is its cheap form behind ``DataParallel(verify_every=K)``.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.runtime import hostsync
from jddp._src.runtime import mesh as mesh_lib
from jddp._src.tree import key_path_str

# ----------------------------------------------------------------------------- consistent start


class LeafDesc(NamedTuple):
    """What must agree across processes for one leaf: its path, shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.path}: {self.dtype}{list(self.shape)}"


def describe(tree: Any) -> tuple[LeafDesc, ...]:
    """The :class:`LeafDesc` of every leaf of ``tree``, in ``jax.tree.leaves`` order."""
    return tuple(
        LeafDesc(key_path_str(path), tuple(int(d) for d in np.shape(leaf)),
                 str(leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    )


def fingerprint(desc: Sequence[LeafDesc]) -> np.ndarray:
    """One int32 per leaf (a CRC-32 of its description), stable across processes.

    Python's ``hash`` is salted per process, so it cannot be compared between processes.
    """
    return np.array(
        [zlib.crc32(repr(tuple(d)).encode()) for d in desc], dtype=np.uint32
    ).view(np.int32)


def check_same_structure(
    local_desc: Sequence[LeafDesc],
    all_descs: Sequence[Sequence[LeafDesc | int]],
    what: str = "params",
    process_index: int | None = None,
    fix: str = "Every process must build the same model (same code, config and dtypes) before init.",
) -> None:
    """Raises ValueError unless every process's tree matches process 0's.

    Args:
      local_desc: this process's :func:`describe` of the tree.
      all_descs: for every process (index = process id), its descriptions or its
        :func:`fingerprint` (what a multi-process gather can carry).
      what: the tree's name, for the message.
      process_index: this process (default: ``jax.process_index()``).
      fix: the last sentence of the message: what to do about it.
    """
    if process_index is None:
        process_index = jax.process_index()
    prints: list[list[int]] = []
    for d in all_descs:
        if len(d) and isinstance(d[0], tuple):
            prints.append(fingerprint([LeafDesc(*x) for x in d]).tolist())  # type: ignore[misc]
        else:
            prints.append([int(x) for x in d])  # type: ignore[arg-type]
    ref = prints[0]
    for p, other in enumerate(prints[1:], start=1):
        if other == ref:
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b),
            min(len(ref), len(other)),
        )
        mine = str(local_desc[first]) if first < len(local_desc) else "<no such leaf>"
        theirs = ""
        if isinstance(all_descs[p], Sequence) and first < len(all_descs[p]) and isinstance(
            all_descs[p][first], tuple
        ):
            zero = all_descs[0][first] if first < len(all_descs[0]) else "<no such leaf>"
            theirs = f" Process 0 has {zero}; process {p} has {all_descs[p][first]}."
        raise ValueError(
            f"The {what} differ between processes: process {p} does not match process 0 "
            f"({len(other)} vs {len(ref)} leaves); first difference at leaf {first}, which on this "
            f"process (#{process_index}) is {mine}.{theirs} {fix}"
        )


def check_processes_agree(tree: Any, what: str, fix: str) -> None:
    """Raises ValueError unless every process holds a tree of this structure, shapes and dtypes
    (one small host all-gather; nothing with one process).

    Args:
      fix: what to do about a mismatch (the message's last sentence).
    """
    if jax.process_count() == 1:
        return
    desc = describe(tree)
    prints = fingerprint(desc)
    lengths = np.asarray(hostsync.allgather(np.array([len(prints)], np.int32)))
    width = int(lengths.max())
    padded = np.full((width + 1,), -1, np.int32)
    padded[0] = len(prints)
    padded[1:len(prints) + 1] = prints
    gathered = np.asarray(hostsync.allgather(padded)).reshape(-1, width + 1)
    all_prints = [row[1:row[0] + 1].tolist() for row in gathered]
    check_same_structure(desc, all_prints, what, fix=fix)


def sync_from_process0(tree: Any, what: str = "params") -> Any:
    """Checks that every process holds a tree like this one, then returns process 0's values.

    Single-process: returns ``tree`` itself, with no check and no copy.
    """
    if jax.process_count() == 1:
        return tree
    check_processes_agree(
        tree, what, "Every process must build the same model (same code, config and dtypes) "
        "before init."
    )
    return hostsync.broadcast_from_process0(tree)


# ----------------------------------------------------------------------------- replica check


class Divergence(NamedTuple):
    """A leaf whose copies differ between replicas.

    Attributes:
      path: the leaf's path.
      max_abs_diff: the largest ``|x_replica - x_replica0|`` over replicas (``inf`` for NaN/Inf
        mismatches and for differing integer leaves).
      replicas: the replicas (positions on the mesh) that differ from replica 0 by more than the
        tolerance.
    """

    path: str
    max_abs_diff: float
    replicas: tuple[int, ...]

    def __str__(self) -> str:
        if self.max_abs_diff != self.max_abs_diff:  # nan: found by a hash, size unknown
            return f"{self.path}: differs on replicas {list(self.replicas)}"
        return (f"{self.path}: max |x - x_replica0| = {self.max_abs_diff:.3g} on replicas "
                f"{list(self.replicas)}")


class ReplicaDivergenceError(ValueError):
    """Raised when replicated values differ between devices."""

    def __init__(self, divergences: Sequence[Divergence], atol: float, how: str = "") -> None:
        self.divergences = tuple(divergences)
        lines = "\n  ".join(str(d) for d in self.divergences[:20])
        extra = len(self.divergences) - 20
        more = f"\n  ... and {extra} more" if extra > 0 else ""
        what = f"({how})" if how else f"(atol={atol})"
        super().__init__(
            f"{len(self.divergences)} replicated leaves differ between replicas {what}:\n"
            f"  {lines}{more}"
        )


def _numeric(x: jax.Array) -> jax.Array:
    """A key array as its key data, a bool array as uint8: values arithmetic can compare."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x


def _local_diff(x: jax.Array, axis: Any) -> jax.Array:
    """Inside shard_map: max |x - the first copy's x| over ``axis``, for this device's copy."""
    x = _numeric(x)
    # The first copy along the axis, exactly: every other term of the sum is zero.
    x0 = lax.psum(jnp.where(lax.axis_index(axis) == 0, x, jnp.zeros_like(x)), axis)
    if x.size == 0:
        return jnp.float32(0)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        nan, nan0 = jnp.isnan(x), jnp.isnan(x0)
        same = (x == x0) | (nan & nan0)
        diff = jnp.abs(x - x0).astype(jnp.float32)
        d = jnp.where(same, 0.0, jnp.where(nan | nan0, jnp.inf, diff))
        return jnp.max(d).astype(jnp.float32)
    return jnp.where(jnp.any(x != x0), jnp.float32(jnp.inf), jnp.float32(0))


def _spec_axes(spec: P) -> frozenset:
    """The mesh axes a ``PartitionSpec`` shards over."""
    out: set = set()
    for entry in spec:
        if entry is None:
            continue
        out.update(entry if isinstance(entry, tuple | list) else (entry,))
    return frozenset(out)


def _gathered(mesh: Mesh, specs: tuple[P, ...], per_device: Any) -> Any:
    """A jitted function of the leaves: ``per_device(leaves)`` on each device, all-gathered."""
    names = tuple(mesh.axis_names)

    def local(leaves):
        return lax.all_gather(per_device(leaves), names if len(names) > 1 else names[0])

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=P(),
                                 check_vma=False))


@functools.lru_cache(maxsize=16)
def _diff_fn(mesh: Mesh, specs: tuple[P, ...]):
    names = tuple(mesh.axis_names)

    def diffs(leaves):
        out = []
        for x, spec in zip(leaves, specs, strict=True):
            # Copies of a leaf sharded over some axes are compared along the others only.
            along = tuple(a for a in names if a not in _spec_axes(spec))
            out.append(_local_diff(x, along) if along else jnp.float32(0))
        return jnp.stack(out) if out else jnp.zeros((0,))

    return _gathered(mesh, specs, diffs)


def _leaf_spec(path: Any, leaf: Any, mesh: Mesh) -> P:
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and sharding.is_fully_replicated:
        return P()
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        if _spec_axes(sharding.spec) >= frozenset(mesh.axis_names):
            raise TypeError(
                f"Leaf {key_path_str(path)} is not a replicated value: it is sharded over every "
                f"mesh axis ({sharding.spec}), so no two devices hold copies to compare."
            )
        return sharding.spec
    raise TypeError(
        f"Leaf {key_path_str(path)} is neither replicated nor sharded on this mesh (sharding: "
        f"{sharding}); verify_replicas compares the copies of replicated values (and of "
        "per-replica values along the axes they are not sharded over)."
    )


def verify_replicas(
    tree: Any,
    mesh: Mesh | None = None,
    *,
    atol: float = 0.0,
    raise_error: bool = True,
) -> list[Divergence]:
    """Compares every device's copy of each replicated leaf of ``tree`` with replica 0's.

    Runs one small jitted ``shard_map`` (a masked ``psum`` per leaf to fetch replica 0's copy, and
    an ``all_gather`` of one float per leaf and device); only that table comes back to the host.
    A leaf sharded over some mesh axes (local SGD's per-replica parameters on the ``hosts`` axis)
    is compared along the other axes only (the devices of a host hold the same copy).

    Args:
      tree: a pytree of ``jax.Array``s on ``mesh``, replicated or sharded with a
        ``NamedSharding`` of ``mesh`` (e.g. ``state.params``).
      mesh: the data mesh (default: ``jddp.data_mesh()``).
      atol: the largest absolute difference tolerated (0: values must be equal; NaN equals NaN).
      raise_error: raise :class:`ReplicaDivergenceError` if any leaf diverged.

    Returns:
      The diverged leaves (empty when the replicas agree); ``replicas`` are device positions
      in ``mesh.devices.flat``.
    """
    mesh = mesh if mesh is not None else mesh_lib.data_mesh()
    mesh_lib.check_mesh(mesh)
    path_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    specs = tuple(_leaf_spec(path, leaf, mesh) for path, leaf in path_leaves)
    if not path_leaves:
        return []
    table = _diff_fn(mesh, specs)(tuple(leaf for _, leaf in path_leaves))
    table = np.asarray(table.addressable_data(0)).reshape(mesh.size, -1)  # [device, leaf]
    out = []
    for j, (path, _) in enumerate(path_leaves):
        bad = tuple(int(r) for r in np.nonzero(table[:, j] > atol)[0])
        if bad:
            out.append(Divergence(key_path_str(path), float(table[:, j].max()), bad))
    if out and raise_error:
        raise ReplicaDivergenceError(out, atol)
    return out


# ----------------------------------------------------------------------------- cheap sentinel


def _leaf_hash(x: jax.Array) -> jax.Array:
    """One uint32 per leaf copy: a position-weighted sum of its bits (wrapping). Equal copies
    give equal hashes on every device (integer sums do not depend on the reduction order); a
    changed element changes it unless another change cancels it exactly."""
    x = _numeric(x)
    width = jnp.dtype(x.dtype).itemsize * 8
    bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}")).reshape(-1)
    if width == 64:
        bits = bits ^ (bits >> 32)
    bits = bits.astype(jnp.uint32)
    # Knuth's multiplicative constant spreads positions over the 32 bits: swapped elements
    # change the sum too.
    weights = jnp.arange(1, bits.size + 1, dtype=jnp.uint32) * jnp.uint32(2654435761)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


@functools.lru_cache(maxsize=16)
def _hash_fn(mesh: Mesh, specs: tuple[P, ...]):
    return _gathered(mesh, specs, lambda leaves: jnp.stack([_leaf_hash(x) for x in leaves]))


def _copy_groups(mesh: Mesh, spec: P) -> list[list[int]]:
    """Device positions (``mesh.devices.flat`` order) that hold the same piece of a leaf
    sharded as ``spec``: one group per piece (one group of every device when replicated)."""
    sharded = _spec_axes(spec)
    names = list(mesh.axis_names)
    groups: dict[tuple, list[int]] = {}
    for pos, coord in enumerate(np.ndindex(*mesh.devices.shape)):
        key = tuple(c for a, c in zip(names, coord, strict=True) if a in sharded)
        groups.setdefault(key, []).append(pos)
    return [g for g in groups.values() if len(g) > 1]


def fingerprint_replicas(tree: Any, mesh: Mesh) -> list[Divergence]:
    """The cheap check behind ``DataParallel(verify_every=K)``: the leaves whose copies differ,
    from one uint32 hash per leaf and device (one small all-gather; unsharded leaves only).

    Returns:
      The diverged leaves; ``max_abs_diff`` is ``nan`` (a hash does not say by how much).
    """
    axes = frozenset(mesh.axis_names)
    picked = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or (not sharding.is_fully_replicated and (
                not isinstance(sharding, NamedSharding) or _spec_axes(sharding.spec) >= axes)):
            continue
        picked.append((path, leaf, _leaf_spec(path, leaf, mesh)))
    if not picked:
        return []
    specs = tuple(s for _, _, s in picked)
    table = _hash_fn(mesh, specs)(tuple(leaf for _, leaf, _ in picked))
    table = np.asarray(table.addressable_data(0)).reshape(mesh.size, -1)  # [device, leaf]
    out = []
    for j, (path, _, spec) in enumerate(picked):
        bad: list[int] = []
        for group in _copy_groups(mesh, spec):
            values, counts = np.unique(table[group, j], return_counts=True)
            if len(values) > 1:
                common = values[np.argmax(counts)]
                bad += [p for p in group if table[p, j] != common]
        if bad:
            out.append(Divergence(key_path_str(path), float("nan"), tuple(sorted(bad))))
    return out


def check_every(tree: Any, mesh: Mesh, step: int) -> None:
    """Raises :class:`ReplicaDivergenceError` if :func:`fingerprint_replicas` finds diverged
    leaves in ``tree`` (checked after call ``step`` of ``ddp.step``)."""
    found = fingerprint_replicas(tree, mesh)
    if found:
        raise ReplicaDivergenceError(
            found, 0.0, f"found by verify_every after step call {step} (replicas: the devices "
            "whose copy differs from the most common one; ddp.verify(state) gives the sizes)")
