"""Every form of replica groups XLA prints (``jddp._src.introspect.hlo.parse_replica_groups``):
explicit lists, iota with and without a transpose, and the partitioner's mesh-axes form, against an
independent reading (a device's coordinates on the mesh) over many shapes, and against the
groups XLA prints in another form for the same reduction (``shard_map``'s ``psum``)."""

from __future__ import annotations

import itertools
import math
import random
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.introspect import hlo
from jddp.perf import schedule

parse = hlo.parse_replica_groups


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0
            for rest in _factorizations(n // d, parts - 1)]


def _by_coordinates(sizes, ids, grouped):
    """The groups by definition: devices sharing their coordinates on the axes not grouped,
    groups ordered by those coordinates, members by the grouped ones (row-major, mesh order)."""
    ids = np.asarray(ids).reshape(sizes)
    rest = [a for a in range(len(sizes)) if a not in grouped]
    out = []
    for outer in itertools.product(*(range(sizes[a]) for a in rest)):
        group = []
        for inner in itertools.product(*(range(sizes[a]) for a in sorted(grouped))):
            index = [0] * len(sizes)
            for a, i in zip(rest, outer, strict=True):
                index[a] = i
            for a, i in zip(sorted(grouped), inner, strict=True):
                index[a] = i
            group.append(int(ids[tuple(index)]))
        out.append(tuple(group))
    return tuple(out)


def _mesh_text(names, sizes, grouped, device_ids=None):
    axes = ",".join(f"'{a}'={s}" for a, s in zip(names, sizes, strict=True))
    ids = "" if device_ids is None else f", device_ids=({device_ids})"
    return f"mesh[{axes}]{ids} {{{','.join(repr(names[a]) for a in grouped)}}}"


def _random_mesh(rnd: random.Random):
    n = rnd.choice([2, 4, 6, 8, 12, 16, 24])
    sizes = rnd.choice(_factorizations(n, rnd.randint(1, 4)))
    names = [f"axis_{i}" for i in range(len(sizes))]
    grouped = sorted(rnd.sample(range(len(sizes)), rnd.randint(1, len(sizes))))
    return names, sizes, grouped


@pytest.mark.parametrize("seed", range(6))
def test_mesh_form_groups_the_devices_that_share_the_other_coordinates(seed):
    """200 random meshes (1-4 axes, 2-24 devices, axes of size 1 too), random grouped axes, in
    iota order, in an order given as ``device_ids=(0,5,...)`` and as ``device_ids=([a,b]T(1,0))``."""
    rnd = random.Random(seed)
    for _ in range(200 // 6 + 1):
        names, sizes, grouped = _random_mesh(rnd)
        n = math.prod(sizes)
        want = _by_coordinates(sizes, range(n), grouped)
        assert parse(_mesh_text(names, sizes, grouped)) == want
        assert sorted(len(g) for g in want) == [math.prod(sizes[a] for a in grouped)] * len(want)
        order = list(range(n))
        rnd.shuffle(order)
        got = parse(_mesh_text(names, sizes, grouped, ",".join(map(str, order))))
        assert got == _by_coordinates(sizes, order, grouped)
        # An iota order: the ids of a random reshape of n, transposed.
        dims = rnd.choice(_factorizations(n, rnd.randint(1, 3)))
        perm = list(range(len(dims)))
        rnd.shuffle(perm)
        ids = np.arange(n).reshape(dims).transpose(perm).reshape(-1)
        text = f"[{','.join(map(str, dims))}]" + (f"T({','.join(map(str, perm))})"
                                                   if len(dims) > 1 else "")
        assert parse(_mesh_text(names, sizes, grouped, text)) == _by_coordinates(
            sizes, ids, grouped)


@pytest.mark.parametrize("seed", range(3))
def test_iota_and_explicit_forms_over_many_shapes(seed):
    """``[G,S]<=[dims]T(perm)`` is the iota array reshaped, transposed, cut into G groups of S;
    the explicit form lists them; both read back what was written."""
    rnd = random.Random(100 + seed)
    for _ in range(60):
        n = rnd.choice([2, 4, 8, 12, 16, 32])
        dims = rnd.choice(_factorizations(n, rnd.randint(1, 4)))
        perm = list(range(len(dims)))
        rnd.shuffle(perm)
        size = rnd.choice([d for d in range(1, n + 1) if n % d == 0])
        ids = np.arange(n).reshape(dims).transpose(perm).reshape(n // size, size)
        want = tuple(tuple(int(i) for i in row) for row in ids)
        t = f"T({','.join(map(str, perm))})" if len(dims) > 1 else ""
        assert parse(f"[{n // size},{size}]<=[{','.join(map(str, dims))}]{t}") == want
        explicit = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in want) + "}"
        assert parse(explicit) == want
    assert parse("{{0,1},{2,3}}") == ((0, 1), (2, 3))
    assert parse("[4,2]<=[2,4]T(1,0)") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert parse("{}") == () == parse("")


def test_sub_axes_and_quoting():
    """Sub-axes ``a:(pre)size`` (the shardy meaning: ``size`` devices at stride ``n/(pre*size)``,
    the part after the ``pre`` major ones); names quoted or not; several grouped axes."""
    # a=8 split as (pre, size, rest): a:(1)2 is the major factor, a:(4)2 the minor one.
    assert parse("mesh[a=8] {a:(1)2}") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert parse("mesh[a=8] {a:(2)2}") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert parse("mesh[a=8] {a:(4)2}") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert parse("mesh[a=8] {a:(1)2,a:(4)2}") == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert parse("mesh['x'=2,'y'=4] {'y'}") == parse("mesh[x=2,y=4] {y}") == (
        (0, 1, 2, 3), (4, 5, 6, 7))
    assert parse('mesh["x"=2,"y"=4] {"x"}') == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert parse("mesh['x'=2,'y'=2,'z'=2] {'x','z'}") == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert parse("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}") == (tuple(range(8)),)


@pytest.mark.parametrize("text", [
    "bogus", "{{0,1}x}", "[2,4]<=", "mesh[a=8] {b}", "mesh[a=8], device_ids=(0,1) {a}",
    "mesh[a=8] {a:(3)2}", "maximal_mesh[device_id=0] {}", "[2,4]<=[6]"])
def test_unreadable_forms_raise_naming_the_text(text):
    with pytest.raises(ValueError, match="cannot read replica groups"):
        parse(text)


def test_known_groups_warns_and_returns_none_for_an_unreadable_form():
    with pytest.warns(hlo.UnknownReplicaGroupsWarning, match="could not read the replica groups"):
        assert hlo.known_groups("mesh_v9<<8>> {x}", "all-reduce") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hlo.known_groups("[1,8]<=[8]") == (tuple(range(8)),)


def test_the_mesh_form_with_device_ids_is_one_attribute():
    """The mesh form holds a top-level comma (``mesh[...], device_ids=(...) {...}``): the
    instruction's ``replica_groups`` attribute keeps it whole."""
    text = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(f32[4]{0} %p), channel_id=1, replica_groups=GROUPS, ATTRS
}
""".replace("GROUPS", "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}").replace(
        "ATTRS", "use_global_device_ids=true, to_apply=%add")
    (c,) = schedule.collectives(text)
    assert c.replica_groups == "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    assert c.groups == ((0, 1, 2, 3), (4, 5, 6, 7))  # ids [[0,4],[1,5],[2,6],[3,7]]
    assert c.instruction.attributes["use_global_device_ids"] == "true"


# ------------------------------------------------- against XLA's other form for the same groups


def _compiled_groups(fn, x):
    text = jax.jit(fn).lower(x).compile().as_text()
    return [(c.replica_groups, c.groups) for c in schedule.collectives(text)]


MESHES = [((8,), ("a",)), ((2, 4), ("a", "b")), ((4, 2), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))]


@pytest.mark.parametrize("shape,names", MESHES, ids=[str(s) for s, _ in MESHES])
def test_mesh_form_equals_the_groups_shard_map_prints_for_the_same_reduction(shape, names):
    """The partitioner's sum of a sharded array prints the mesh form; ``shard_map``'s ``psum``
    over the same mesh axes prints an explicit or iota form. For every ordered subset of axes
    (so every transposed device order) and a shuffled device list, the groups are the same,
    member order included."""
    rnd = random.Random(len(shape))
    seen_mesh_form = 0
    for k in range(1, len(names) + 1):
        for axes in itertools.permutations(names, k):
            order = list(range(8))
            rnd.shuffle(order)
            mesh = Mesh(np.array(jax.devices()[:8])[order].reshape(shape), names)
            spec = P(axes if k > 1 else axes[0])
            x = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, spec))
            partitioned = _compiled_groups(lambda x: jnp.sum(x, axis=0), x)
            psum = _compiled_groups(jax.shard_map(
                lambda x, axes=axes: jax.lax.psum(jnp.sum(x, axis=0), axes), mesh=mesh,
                in_specs=spec, out_specs=P()), x)
            (text, got), (other, want) = partitioned[-1], psum[-1]
            seen_mesh_form += text.startswith("mesh[")
            assert not other.startswith("mesh[")
            assert got == want, (axes, text, other)
            # Group sizes from the mesh: the devices of the reduced axes.
            assert {len(g) for g in got} == {math.prod(shape[names.index(a)] for a in axes)}
    assert seen_mesh_form > 0
