"""Owner-sharded placement, ``jddp.ZeRO(stage=s, shard="owner")`` (jddp/_src/place/owner.py): each leaf
updated whole on one device. The orthogonalization done once (FLOPs per device of the compiled
step) without collectives inside it; owner rows; what the plan says it moves; refusals. Equality
to single-device ``optax.contrib.muon`` at stages 1-3 (balanced owner rows, clipping,
accumulation, 2 processes) is the combination matrix's (tests/test_matrix.py, "owner" rows)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp._src.place import owner, owner_plan
from tests import _reference as ref
from tests import test_matrix as tm
from tests._models import layers_loss, layers_params
from tests.launch_util import run_launcher

WIDTH, LAYERS, ROWS = 32, 16, 32


def _params(layers=LAYERS, width=WIDTH):
    return layers_params(0, layers, width)


_loss = layers_loss


def _batches(n, rows=ROWS, width=WIDTH):
    rng = np.random.default_rng(1)
    return [{k: jnp.asarray(rng.normal(size=(rows, width)), jnp.float32) for k in ("x", "y")}
            for _ in range(n)]


def _muon():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.contrib.muon(2e-2))


def test_assign_balances_the_update_cost_and_names_what_cannot_be():
    shapes = [(64, 64)] * 6 + [(64,)] * 6
    got = owner.assign(shapes, 4)
    # 6 equal matrices on 4 devices: 2, 2, 1, 1 (no device gets 3); vectors fill the light ones
    per = [sum(1 for i in range(6) if got.owner[i] == d) for d in range(4)]
    assert sorted(per) == [1, 1, 2, 2]
    assert got.too_large == () and got.imbalance() < 1.4
    big = owner.assign([(256, 256), (16, 16), (16, 16)], 2)
    assert big.too_large == (0,)  # alone more than half the work
    assert big.owner[1] == big.owner[2] != big.owner[0]
    text = big.describe(["big", "a", "b"])
    assert "too large to balance (each alone more than 1/2 of the update): big" in text and "device 0" in text
    # Newton-Schulz cost m*n*min(m,n), a stack of matrices counts each
    assert owner.update_cost((8, 4)) == 8 * 4 * 4 and owner.update_cost((3, 8, 4)) == 3 * 128
    assert owner.update_cost((5,)) == 5


def test_state_leaves_follow_their_parameter():
    params = {"a": {"w": jnp.zeros((4, 3))}, "w": jnp.zeros((2, 2)), "b": jnp.zeros(3)}
    opt_state = _muon().init(params)
    owners = owner.Owners((1, 2, 3), (0.0,) * 3, (0.0,) * 4, ())  # leaves: a.w, b, w
    got = owner.state_owners(params, opt_state, owners)
    for (path, x), o in zip(jax.tree_util.tree_leaves_with_path(opt_state), got, strict=True):
        name = jax.tree_util.keystr(path)
        if name.endswith("['a']['w']"):
            assert o == 1
        elif name.endswith("['w']") and np.shape(x) == (2, 2):
            assert o == 3
        elif name.endswith("['b']"):
            assert o == 2
        else:  # counts and Newton-Schulz coefficients
            assert o == 0, name


def _train(place, opt, batches, accumulate=1, mesh=None):
    mesh = mesh or jddp.data_mesh()
    ddp = jddp.DataParallel(_loss, opt, mesh=mesh, place=place,
                            accumulate=jddp.Accumulate(steps=accumulate))
    state = ddp.init(_params())
    for b in batches:
        state, _ = ddp.step(state, jddp.shard_batch(b, mesh))
    return ddp, state


@functools.cache
def _program(place, optimizer):
    """FLOPs per device of the compiled step and its collectives (``optimizer``: a name in
    ``OPTIMIZERS``; cached: the replicated programs are the same for every stage)."""
    mesh = jddp.data_mesh()
    ddp = jddp.DataParallel(_loss, OPTIMIZERS[optimizer](), mesh=mesh, place=place)
    state = ddp.init(_params())
    batch = jddp.shard_batch(_batches(1)[0], mesh)
    cost = ddp.step.lower(state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]), len(ddp.report(state, batch).collectives)


OPTIMIZERS = {"muon": lambda: optax.contrib.muon(2e-2), "adamw": lambda: optax.adamw(1e-3)}


@pytest.mark.parametrize("stage", [1, 3])
def test_orthogonalization_runs_once_and_without_collectives(stage):
    """FLOPs per device <= AdamW's at the stage + 1.15 x the whole model's Newton-Schulz / N
    (2 matrices per device); collectives <= AdamW's + one per matrix (GSPMD's even sharding
    puts collectives inside every Newton-Schulz iteration)."""
    rep_muon, _ = _program(jddp.Replicate(), "muon")
    rep_adamw, _ = _program(jddp.Replicate(), "adamw")
    ns_whole = rep_muon - rep_adamw
    flops, cols = _program(jddp.ZeRO(stage=stage, shard="owner"), "muon")
    a_flops, a_cols = _program(jddp.ZeRO(stage=stage), "adamw")
    _, even_cols = _program(jddp.ZeRO(stage=stage), "muon")
    n = jax.device_count()
    assert ns_whole > 4 * rep_adamw  # Newton-Schulz dominates: the bound below means something
    assert flops <= a_flops + 1.15 * ns_whole / n, (flops, a_flops, ns_whole / n)
    assert cols <= a_cols + LAYERS, (cols, a_cols)
    assert even_cols > a_cols + LAYERS  # what owner sharding avoids


def test_an_optimizer_reading_another_owners_parameters_is_refused():
    def param_norm_scaled():  # scales every update by the global norm of the parameters
        def update(updates, state, params):
            norm = optax.tree.norm(params)  # once, not once per leaf (32 x 32 reductions traced)
            return jax.tree.map(lambda u: u * norm, updates), state
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    with pytest.raises(ValueError, match=r"shard='owner'.*reads the parameter"):
        _train(jddp.ZeRO(stage=3, shard="owner"), param_norm_scaled(), _batches(1))
    # stored whole (stages 1-2), every device has every parameter: accepted and exact
    _, state = _train(jddp.ZeRO(stage=1, shard="owner"), param_norm_scaled(), _batches(1))
    want = ref.train(_loss, param_norm_scaled(), _params(), [_batches(1)]).params
    assert ref.max_abs_diff(jax.tree.map(np.asarray, state.params), want) < 1e-6


def test_bad_shard_and_deterministic_are_refused():
    with pytest.raises(ValueError, match="ZeRO.shard must be 'even'.*or 'owner'"):
        jddp.ZeRO(stage=2, shard="rows")
    with pytest.raises(ValueError, match="does not combine with place=jddp.ZeRO"):
        jddp.DataParallel(_loss, _muon(), mesh=jddp.data_mesh(),
                          place=jddp.ZeRO(stage=1, shard="owner"), reduce=jddp.Deterministic())


@pytest.mark.parametrize("stage", [2, 3])
def test_the_plan_says_how_fewer_matrices_than_devices_split_and_what_it_costs(stage):
    """With 3 matrices on 8 devices (the combination matrix's MLP), the report names the idle
    devices, the busiest device's share against an even one, each bucket's route (even pieces
    to the owners) and the bytes those all-to-alls and the updates' way back cost: the bytes
    of the compiled program's collectives."""
    mesh = jddp.data_mesh()
    ddp = jddp.DataParallel(tm.mlp_loss, optax.contrib.muon(2e-2), mesh=mesh,
                            place=jddp.ZeRO(stage=stage, shard="owner"),
                            reduce=jddp.Buckets(**tm.CAPS))
    state = ddp.init(tm.mlp_params(0, tm.SIZES))
    rep = ddp.report(state, jddp.shard_batch(tm._batches(1)[0], mesh))
    text, plan = str(rep), rep.owners
    idle = sorted(set(range(8)) - set(plan.by_path().values()))
    assert idle and f"devices {', '.join(map(str, idle))} update nothing" in text
    assert f"{plan.owners.imbalance():.2f}x an even share (12.5%)" in text
    assert plan.owners.imbalance() > 2 and "(3 matrices) on 8 devices" in text
    routes = plan.routes
    assert routes.buckets and {r.kind for r in routes.buckets} == {owner_plan.EVEN}
    assert text.count("even pieces (owner rows would send more)") == len(routes.buckets)
    kinds = {}
    for c in rep.collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + c.bytes
    assert routes.grads_bytes > 0
    if stage == 3:  # the gradients' pieces to the owners and the updates' pieces back
        assert kinds["all-to-all"] == routes.grads_bytes + routes.updates_bytes
        assert "updates back to the even pieces" in text
    else:  # the gradients' all-to-all; the owners' rows all-gathered, wider than even pieces
        assert kinds["all-to-all"] == routes.grads_bytes
        assert kinds["all-gather"] == routes.updates_bytes > routes.even_updates_bytes


def _comm_bytes_and_report(place, opt, accumulate=1, mesh=None, **kw):
    """``(sum of metrics["comm_bytes"] over one window, ddp.report(state, batch), last metrics)``."""
    mesh = mesh or jddp.data_mesh()
    ddp = jddp.DataParallel(_loss, opt, mesh=mesh, place=place,
                            accumulate=jddp.Accumulate(steps=accumulate), **kw)
    state = ddp.init(_params(4))
    batch = jddp.shard_batch(_batches(1)[0], mesh)
    rep = ddp.report(state, batch)
    total = 0.0
    for _ in range(accumulate):
        state, metrics = ddp.step(state, batch)
        total += float(metrics["comm_bytes"])
    return total, rep, metrics


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_comm_bytes_are_the_compiled_programs_bytes(stage, clip):
    """``metrics["comm_bytes"]`` equals ``ddp.report(...).sent_per_step``: the owners' all-to-alls
    of the optimizer state and the gradients (or the gradients' all-gather when a global norm
    reads every leaf) are counted from the buffers the update moves, with 4 matrices on 8
    devices (owners with nothing to update send padding too)."""
    opt = _muon() if clip else optax.contrib.muon(2e-2)
    got, rep, _ = _comm_bytes_and_report(jddp.ZeRO(stage=stage, shard="owner"), opt)
    assert rep.sent_per_step == pytest.approx(got, rel=1e-6)
    kinds = {c.kind for c in rep.collectives}
    # from stage 2 the gradients reach their owners in the reduce-scatter's owner rows; with 4
    # matrices on 8 devices some leaves straddle two rows and those segments go by an
    # all-to-all (all-gathered rows for a global norm); at stage 3 the updates' pieces come back
    assert ("all-to-all" in kinds) == (stage == 3 or (stage == 2 and not clip))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_optimizer_state_does_not_move(stage):
    """The optimizer state lives packed per owner (each device its own leaves'): the compiled
    step's collective bytes are at most AdamW's at the same even stage (stage 1: the all-reduce
    and the parameters' all-gather; stage 2: the reduce-scatter in owner rows, which lands each
    leaf's gradient on its owner, and the owners' updates all-gathered), plus at stage 3 the
    updates' pieces sent back (the parameters are stored as even pieces); nothing of the
    optimizer state, nor (balanced rows) of the gradients. The report shows each leaf's owner
    and the route it states (balanced rows, the updates' bytes) is the program's."""
    def program(place, opt):
        mesh = jddp.data_mesh()
        ddp = jddp.DataParallel(_loss, opt, mesh=mesh, place=place)
        state = ddp.init(_params())
        rep = ddp.report(state, jddp.shard_batch(_batches(1)[0], mesh))
        by_kind = {}
        for c in rep.collectives:
            by_kind[c.kind] = by_kind.get(c.kind, 0) + c.bytes
        return rep.bytes_per_step, by_kind, state, rep

    got, kinds, state, rep = program(jddp.ZeRO(stage=stage, shard="owner"),
                                     optax.contrib.muon(2e-2))
    want, adamw_kinds, _, _ = program(jddp.ZeRO(stage=stage), optax.adamw(1e-3))
    pieces = sum(int(np.prod(np.shape(x))) * 4 for x in jax.tree.leaves(_params())) // 8
    moved = {1: 0, 2: 0, 3: pieces}[stage]  # 16 + 16 equal leaves: balanced rows
    assert kinds.get("all-to-all", 0) == moved
    assert got - moved <= want, (got, want, kinds, adamw_kinds)
    # each device stores 1/8 of the state: its two matrices' momentum, its two biases' moments
    rows = state.opt_state.rows
    assert [r.shape for r in rows] == [(8, 2 * WIDTH * WIDTH + 2 * 2 * WIDTH)]
    assert all(s.data.shape == (1, rows[0].shape[1]) for s in rows[0].addressable_shards)
    # the report shows each leaf's owner, two matrices per device, and says the rows are balanced
    owners = rep.to_dict()["owners"]
    assert sorted(owners) == sorted(f"l{i:02d}.{k}" for i in range(LAYERS) for k in "wb")
    per = [sum(1 for p, d in owners.items() if p.endswith(".w") and d == k) for k in range(8)]
    assert per == [2] * 8 and "l00.w" in str(rep) and "1.00x an even share" in str(rep)
    routes = rep.owners.routes
    assert [r.kind for r in routes.buckets] == ([owner_plan.BALANCED] if stage >= 2 else [])
    assert routes.grads_bytes == 0 and routes.updates_bytes == (pieces if stage == 3 else
                                                                routes.even_updates_bytes)
    assert stage < 2 or "each row exactly its owner's leaves" in str(rep)


@pytest.mark.parametrize("case", ["accumulate", "bf16-reduce", "adamw-stage3", "adafactor-offload",
                                  "two-hosts", "two-hosts-hybrid"])
def test_comm_bytes_exact_over_a_window_narrow_dtypes_and_other_optimizers(case):
    """Over an accumulation window (the update runs on the synchronising call only), with
    bfloat16 gradients (XLA:CPU sends them as float32), with AdamW (reads the parameters: stage
    3 sends their pieces to the owners), with Adafactor's factored moments (state leaves shaped
    unlike their parameter) offloaded, and on two hosts, where ``comm_bytes_hosts`` counts the
    all-to-alls' shares sent to the other host (sharding across hosts, or inside each)."""
    place, opt, kw = jddp.ZeRO(stage=2, shard="owner"), _muon(), {}
    if case == "accumulate":
        kw["accumulate"] = 3
    elif case == "bf16-reduce":
        kw["precision"] = jddp.precision.MixedPrecision(param_dtype=jnp.bfloat16,
                                                        reduce_dtype=jnp.bfloat16)
    elif case == "adamw-stage3":
        place, opt = jddp.ZeRO(stage=3, shard="owner"), optax.adamw(1e-3)
    elif case == "adafactor-offload":
        place, opt = jddp.ZeRO(stage=2, shard="owner", offload=True), optax.adafactor(1e-3)
    else:
        kw["mesh"] = jddp.data_mesh(hosts=2)
        place = jddp.ZeRO(stage=3, shard="owner", hybrid=case.endswith("hybrid"))
    got, rep, metrics = _comm_bytes_and_report(place, opt, **kw)
    assert rep.sent_per_window == pytest.approx(got, rel=1e-6)
    if case.startswith("two-hosts"):  # the report's across-hosts bytes are per host
        n = jax.device_count()
        across = float(metrics["comm_bytes_hosts"])
        assert across > 0
        assert rep.across_hosts_per_window * rep.hosts / n == pytest.approx(across, rel=1e-6)


def test_owner_rows_cover_each_leaf_once_and_invert():
    """A bucket's owner rows (jddp/_src/core/owner_rows.py): every split leaf's segments cover
    it once, in order; balanced owners give each row its owner's leaves whole; cutting a row
    into the pieces and joining them again is the identity."""
    from jddp._src.core import owner_rows, zero

    layout = zero.Layout.of([np.zeros(s) for s in [(8, 4), (16,), (5,), (8, 2), (4, 4)]], 4)
    owners = (1, 0, 2, 3, 1)
    rows = owner_rows.bucket_rows(range(5), layout, owners)
    assert rows.split == (0, 1, 3, 4) and rows.width == (32 + 16 + 16 + 16) // 4
    for i in rows.split:
        parts = rows.leaf_parts(i)
        assert [p.start for p in parts] == list(np.cumsum([0] + [p.size for p in parts[:-1]]))
        assert sum(p.size for p in parts) == int(np.prod(layout.shapes[i]))
    grads = {i: jnp.arange(np.prod(layout.shapes[i]), dtype=jnp.float32).reshape(
        layout.shapes[i]) + 100 * i for i in rows.split}
    matrix = owner_rows.encode(rows, grads, 4)
    for d in range(4):
        got = owner_rows.pieces(rows, matrix[d], layout)
        assert {i: x.shape for i, x in got.items()} == {
            i: zero.shard_shape(layout.shapes[i], layout.dims[i], 4) for i in rows.split}
        leaves = [got.get(i, np.zeros(1)) for i in range(5)]
        np.testing.assert_array_equal(owner_rows.row_of(rows, leaves), matrix[d])
    for i in rows.split:
        np.testing.assert_array_equal(owner_rows.whole_from_all(rows, matrix, i,
                                                                layout.shapes[i]), grads[i])
    balanced = owner_rows.bucket_rows([0, 3], zero.Layout.of([np.zeros((8, 4))] * 4, 4),
                                      (0, 0, 0, 1))
    # two leaves on four rows of 16: each fills its owner's row, the rest fills the free rows
    assert [(p.leaf, p.row) for p in balanced.parts] == [(0, 0), (0, 2), (3, 1), (3, 3)]
    # one owner with 40 rows where the others have 32: its extra 56 elements fill the 7 others
    mild = zero.Layout.of([np.zeros((40, 8))] + [np.zeros((32, 8))] * 7, 8)
    rows = owner_rows.bucket_rows(range(8), mild, tuple(range(8)))
    away = [p for p in rows.parts if p.row != p.leaf]
    assert rows.width == (320 + 7 * 256) // 8 and {p.leaf for p in away} == {0} and len(away) == 7
    assert sum(p.size for p in away) == 320 - rows.width and owner_rows.worth_it(rows, tuple(range(8)), 8)
    assert not owner_rows.worth_it(balanced, (0, 0, 0, 1), 4)
    even = owner_rows.bucket_rows(range(4), zero.Layout.of([np.zeros((8, 4))] * 4, 4),
                                  (2, 0, 3, 1))
    assert all(p.row == (2, 0, 3, 1)[p.leaf] and p.size == 32 for p in even.parts)


def _uneven_model():
    """Five unequal matrices (fewer than devices), their biases, a leaf split on 8 rows and an
    odd one kept whole: owners are unbalanced in every bucket, so leaves straddle rows."""
    rng = np.random.default_rng(0)
    dims = {"a": (32, 48), "b": (48, 48), "c": (48, 40), "d": (40, 32), "e": (32, 32)}
    params = {k: {"w": jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32),
                  "b": jnp.asarray(rng.normal(size=(s[1],)) * .1, jnp.float32)}
              for k, s in dims.items()}
    params["odd"] = jnp.asarray(rng.normal(size=(32, 3)) * .1, jnp.float32)
    params["whole"] = jnp.asarray(rng.normal(size=(5,)) * .1, jnp.float32)

    def loss(p, b):
        h = b["x"]
        for k in sorted(dims):
            h = jnp.tanh(h @ p[k]["w"] + p[k]["b"])
        return (jnp.mean((h - b["y"]) ** 2) + 1e-2 * jnp.sum(p["odd"] ** 2)
                + 1e-2 * jnp.sum(p["whole"] ** 2))

    batches = [{k: jnp.asarray(rng.normal(size=(32, 32)), jnp.float32) for k in ("x", "y")}
               for _ in range(2)]
    return params, loss, batches


def _mild_model():
    """Eight matrices in one bucket, one owner's larger (40 x 32 against 32 x 32): its extra
    segment lies in the other owners' rows."""
    rng = np.random.default_rng(2)
    params = {"m": [jnp.asarray(rng.normal(size=(32, 40 if k == 0 else 32)) / 6, jnp.float32)
                    for k in range(8)]}

    def loss(p, b):
        return sum(jnp.mean((jnp.tanh(b["x"] @ w)[:, :32] - b["y"]) ** 2) for w in p["m"])

    batches = [{k: jnp.asarray(rng.normal(size=(32, 32)), jnp.float32) for k in ("x", "y")}
               for _ in range(2)]
    return params, loss, batches


@pytest.mark.parametrize(("model", "stage", "clip"), [
    ("mild", 2, False), ("mild", 3, False), ("mild", 2, True), ("mild", 3, True),
    ("uneven", 2, False), ("uneven", 3, True)])
def test_unbalanced_owner_rows_equal_single_device_and_count_their_bytes(model, stage, clip):
    """Owners unbalanced in a bucket: with one owner's leaf larger, its extra segment lies in
    the other rows and reaches it by an all-to-all (``mild``); with fewer leaves than devices
    in every bucket (``uneven``: three buckets), owner rows would cost more than even pieces and
    the buckets keep them. A global norm all-gathers the rows instead. Equal to single-device
    Muon; ``comm_bytes`` equals the compiled program's bytes."""
    params, loss, batches = _mild_model() if model == "mild" else _uneven_model()
    opt = _muon() if clip else optax.contrib.muon(2e-2)
    mesh = jddp.data_mesh()
    kw = {} if model == "mild" else {"reduce": jddp.Buckets(cap_mb=0.01, first_mb=0.005)}
    ddp = jddp.DataParallel(loss, opt, mesh=mesh, place=jddp.ZeRO(stage=stage, shard="owner"),
                            **kw)
    state = ddp.init(params)
    for b in batches:
        state, metrics = ddp.step(state, jddp.shard_batch(b, mesh))
    assert ddp.bucket_plan.num_buckets == (1 if model == "mild" else 3)
    want = ref.train(loss, opt, params, [[b] for b in batches]).params
    assert ref.max_abs_diff(jax.tree.map(np.asarray, state.params), want) < 1e-6
    rep = ddp.report(state, jddp.shard_batch(batches[0], mesh))
    assert rep.sent_per_step == pytest.approx(float(metrics["comm_bytes"]), rel=1e-6)
    kinds = {}
    for c in rep.collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + c.bytes
    assert "all-reduce" not in kinds and ("all-to-all" in kinds) == (stage == 3 or not clip)
    if model == "mild" and stage == 2 and not clip:
        # an (8, 32) float32 all-to-all: the larger leaf's 224 extra elements, 32 in each of
        # the 7 other rows (even pieces would send it (8, 160))
        assert kinds["all-to-all"] == 8 * 32 * 4


# --------------------------------------------------------------------------- 2 processes x 4

# Owner-rows runs for the 2-process test beside the combination matrix's owner cells (whose
# "16 matrices" rows run balanced owner rows at stages 1-3 with clipping and accumulation):
# rows with an owner's extra segments in other rows.
ROWS_RUNS = (("mild", 2),)


def _rows_case(name):
    """``(params, loss, optimizer, batches, accumulate)`` of an owner-rows run."""
    params, loss, batches = _mild_model()
    return params, loss, optax.contrib.muon(2e-2), batches, 1


def _rows_run(name, stage, repeats=1):
    """The global parameters after training ``name`` at ``ZeRO(stage, shard="owner")`` on all
    devices, ``repeats`` times from the start with one compiled program (numpy trees)."""
    params, loss, opt, batches, accumulate = _rows_case(name)
    mesh = jddp.data_mesh()
    ddp = jddp.DataParallel(loss, opt, mesh=mesh, place=jddp.ZeRO(stage=stage, shard="owner"),
                            accumulate=jddp.Accumulate(steps=accumulate))
    out = []
    for _ in range(repeats):
        state = ddp.init(params)
        for b in batches:
            state, _ = ddp.step(state, jddp.shard_batch(b, mesh))
        out.append(tm._to_numpy(ddp.global_params(state)))
    return out


@functools.cache
def _rows_reference(name):
    params, loss, opt, batches, accumulate = _rows_case(name)
    calls = [batches[i:i + accumulate] for i in range(0, len(batches), accumulate)]
    return jax.tree.leaves(ref.train(loss, opt, params, calls).params)

SCRIPT = r'''
import json, sys
import jax
import jddp
jddp.initialize(timeout_s=60)
import numpy as np
from tests import test_matrix as tm
out = {}
for i, cell in enumerate(tm.CELLS):
    if cell.extra.get("owner_procs") == 2:
        runs = tm.run_cell(cell, multi=True, repeats=2)
        out[str(i)] = [[np.asarray(x).tolist() for x in jax.tree.leaves(r)] for r in runs]
from tests import test_owner as to
for name, stage in to.ROWS_RUNS:
    runs = to._rows_run(name, stage, repeats=2)
    out[f"{name}{stage}"] = [[np.asarray(x).tolist() for x in jax.tree.leaves(r)] for r in runs]
if jax.process_index() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
print("DONE", jax.process_count())
'''


@pytest.mark.slow
def test_two_processes_repeat_bitwise_and_equal_one_process(tmp_path):
    """The owner rows of the combination matrix marked ``owner_procs=2``, and the owner-rows
    runs (``ROWS_RUNS``), on 2 processes x 4 devices: repeats bitwise equal, equal to the 1 x 8
    run and to the single-device reference."""
    script = tmp_path / "owner_job.py"
    script.write_text(SCRIPT)
    rc, out, err, _ = run_launcher(["-n", "2", "--devices-per-process", "4", "--timeout", "420",
                                    str(script), str(tmp_path / "out.json")], timeout=450)
    assert rc == 0, (out[-2000:], err[-4000:])
    results = json.loads((tmp_path / "out.json").read_text())
    cells = [i for i, c in enumerate(tm.CELLS) if c.extra.get("owner_procs") == 2]
    assert len(cells) >= 3 and sorted(k for k in results if k.isdigit()) == sorted(map(str, cells))
    for name, stage in ROWS_RUNS:  # owner rows: repeats bitwise, equal to 1 x 8 and reference
        first, second = ([np.asarray(x, np.float32) for x in r] for r in results[f"{name}{stage}"])
        for a, b in zip(first, second, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} stage {stage}: repeats differ")
        one = jax.tree.leaves(_rows_run(name, stage)[0])
        assert ref.max_abs_diff(first, one) < 1e-6, (name, stage)
        assert ref.max_abs_diff(first, _rows_reference(name)) < 1e-6, (name, stage)
    for i in cells:
        cell = tm.CELLS[i]
        first, second = ([np.asarray(x, np.float32) for x in r] for r in results[str(i)])
        for a, b in zip(first, second, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{tm.cell_id(cell)}: repeats differ")
        # The 1 x 8 run and the reference test_matrix.py's cell computed (cached in this process)
        one = jax.tree.leaves(tm._one_process(i))
        assert ref.max_abs_diff(first, one) < 1e-6, tm.cell_id(cell)
        want = jax.tree.leaves(tm._reference(cell.expect[1], tm._replicas(cell)))
        assert ref.max_abs_diff(first, want) < 1e-6, tm.cell_id(cell)
