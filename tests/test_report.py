"""``ddp.report``: the collectives of the compiled step, their bytes against the bucket plan and
``metrics["comm_bytes"]``, totals per window, levels on a two-level mesh, and memory."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.perf import schedule, topologies
from tests._models import layer_list_like, layer_list_loss

SIZES = [32, 64, 64, 8]
LOSS_BYTES = 4  # the float32 loss rides on the last bucket's all-reduce


def _params():
    rng = np.random.default_rng(0)
    return {f"d{i}": {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32),
                      "b": np.zeros((b,), np.float32)}
            for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True))}


calls = []


def loss_fn(p, b):
    calls.append(1)
    x = b["x"]
    for i in range(3):
        x = x @ p[f"d{i}"]["w"] + p[f"d{i}"]["b"]
        x = jnp.tanh(x) if i < 2 else x
    return jnp.mean((x - b["y"]) ** 2)


def _batch(mesh):
    rng = np.random.default_rng(1)
    return jddp.shard_batch({"x": rng.normal(size=(16, 32)).astype(np.float32),
                             "y": rng.normal(size=(16, 8)).astype(np.float32)}, mesh)


def _ring(nbytes, n):
    return 2 * (n - 1) / n * nbytes


def test_report_matches_the_plan_comm_bytes_and_the_program():
    mesh = jddp.data_mesh()
    n = mesh.size
    ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=mesh,
                            reduce=jddp.Buckets(cap_mb=0.01, first_mb=0.005))
    state, batch = ddp.init(_params()), _batch(mesh)
    calls.clear()
    rep = ddp.report(state, batch)
    plan = ddp.bucket_plan
    assert plan.num_buckets >= 2
    # One all-reduce per bucket, tagged with its bucket, of the bucket's bytes (+ the loss).
    assert [c.kind for c in rep.collectives] == ["all-reduce"] * plan.num_buckets
    assert [c.bucket for c in rep.collectives] == list(range(plan.num_buckets))
    want = [b.nbytes for b in plan.buckets]
    want[-1] += LOSS_BYTES
    assert [c.bytes for c in rep.collectives] == want
    assert all(c.group_size == n and c.level == "local" and c.dtype == "f32" and not c.in_loop
               for c in rep.collectives)
    assert rep.bytes_per_step == sum(want)
    # The same program as the compiled step's, collective by collective.
    text = ddp.step.lower(state, batch).compile().as_text()
    assert [(c.kind, c.nbytes, c.shapes) for c in schedule.collectives(text)] == [
        (c.kind, c.bytes, c.shapes) for c in rep.collectives]
    # The step reuses the report's compile: the loss was traced once.
    state, metrics = ddp.step(state, batch)
    assert len(calls) == 1 and ddp.step.cache_size() == 1
    # comm_bytes counts every collective of the step, the loss riding on the last bucket too.
    assert rep.sent_per_step == pytest.approx(float(metrics["comm_bytes"]), rel=1e-6)
    # Memory: params + two Adam moments at rest, the step's peak from XLA's analysis.
    m = rep.memory
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(_params()))
    assert 3 * param_bytes <= m.at_rest <= 3 * param_bytes + 64
    assert m.peak == m.arguments + m.outputs - m.aliased + m.temporaries
    assert m.arguments >= m.at_rest
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["bytes_per_step"] == sum(want) and len(d["collectives"]) == plan.num_buckets
    assert d["collectives"][0]["bucket"] == 0 and d["memory"]["peak"] == m.peak
    text = str(rep)
    assert "all-reduce" in text and "memory per device" in text and "peak" in text


def test_report_levels_on_two_hosts_and_windows_with_accumulation():
    mesh = jddp.data_mesh(hosts=2)
    n = mesh.size
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh,
                            reduce=jddp.Buckets(cap_mb=0.01, first_mb=0.005),
                            accumulate=jddp.Accumulate(steps=2))
    state, batch = ddp.init(_params()), _batch(mesh)
    rep = ddp.report(state, batch)
    assert rep.hosts == 2 and rep.window == 2
    assert all(c.level == "hosts" and c.in_branch for c in rep.collectives)
    assert rep.bytes_per_step == rep.bytes_per_window / 2
    for _ in range(2):
        state, metrics = ddp.step(state, batch)
    assert bool(metrics["synced"])
    # Per window: what the synchronising call sends (comm_bytes, the loss included).
    assert rep.sent_per_window == pytest.approx(float(metrics["comm_bytes"]), rel=1e-6)
    # comm_bytes_hosts is per device; the report's across-hosts bytes are per host.
    assert rep.across_hosts_per_window * rep.hosts / n == pytest.approx(
        float(metrics["comm_bytes_hosts"]), rel=1e-6)
    # The no-sync program has no collective.
    assert ddp.report(state, batch, sync=False).collectives == ()


@pytest.mark.parametrize("stage,shard", [(3, False), (2, True), (3, True)])
def test_window_totals_count_the_accumulating_branch_per_call(stage, shard):
    """With ``sync=None`` both calls of a window are branches of one program: the accumulating
    branch's collectives (stage 3's gathers, the sharded accumulator's reduce-scatters) run on
    ``k - 1`` calls, the synchronising branch's once; the window's total is the sum of the
    window's ``comm_bytes``."""
    k = 3
    ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1),
                            reduce=jddp.Buckets(cap_mb=0.01, first_mb=0.005),
                            accumulate=jddp.Accumulate(steps=k, shard=shard),
                            place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
    state, batch = ddp.init(_params()), _batch(ddp.config.mesh)
    rep = ddp.report(state, batch)
    assert {c.branch for c in rep.collectives} == {0, 1}
    total = 0.0
    for _ in range(k):
        state, metrics = ddp.step(state, batch)
        total += float(metrics["comm_bytes"])
    assert bool(metrics["synced"])
    assert rep.sent_per_window == pytest.approx(total, rel=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(not topologies.has_gpu_compiler(), reason="no CUDA compiler plugin")
def test_report_on_a_compile_only_gpu_mesh_shows_overlap():
    mesh = topologies.gpu_mesh(8)
    ddp = jddp.DataParallel(layer_list_loss, optax.sgd(0.1), mesh=mesh,
                            reduce=jddp.Buckets(cap_mb=1.0))
    params = layer_list_like(4, 512)
    batch = {k: jax.ShapeDtypeStruct((64, 512), jnp.float32) for k in ("x", "y")}
    rep = ddp.report(ddp.abstract_state(params), batch)
    buckets = rep.by_bucket()
    assert len(buckets) >= 2 and all(c.mode == "async" for c in rep.collectives)
    # Every bucket but the last is hidden behind backward GEMMs.
    assert all(cs[0].overlapped_dots > 0 for b, cs in buckets.items() if b < len(buckets) - 1)
    assert rep.memory is not None and rep.memory.peak > 0
    assert "dots" in str(rep)


OPTIMIZERS = {
    "clip": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
}
_ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1}
_COLLECTIVE_LINE = re.compile(
    r"^\s*(?:ROOT )?%?\S+ = (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter)\(")


def _compiled_operand_bytes(text, n):
    """Each collective's operand bytes per device, read from its result type on its HLO line (an
    all-gather's result is ``n`` operands, a reduce-scatter's one ``n``-th): independent of the
    reader ``ddp.report`` uses."""
    out = []
    for line in text.splitlines():
        m = _COLLECTIVE_LINE.match(line)
        if not m:
            continue
        result = sum(_ELEMENT_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                     for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(1)))
        kind = m.group(2)
        out.append((kind, result // n if kind == "all-gather" else
                    result * n if kind == "reduce-scatter" else result))
    return out


@pytest.mark.parametrize("opt,stage", [("clip", 1), ("clip", 2), ("clip", 3), ("lamb", 3),
                                       ("adafactor", 3)])
def test_report_reads_optimizers_with_global_reductions_over_sharded_leaves(opt, stage):
    """Clipping by the global norm, LAMB's and Adafactor's per-leaf norms over sharded leaves:
    XLA's partitioner prints their all-reduces' groups in its mesh form
    (``mesh['axis_0'=8,'axis_1'=1] {'axis_0'}``). The report reads them: every group the whole
    mesh, bytes exactly the compiled program's, sent bytes the ring model of those."""
    mesh = jddp.data_mesh()
    n = mesh.size
    ddp = jddp.DataParallel(loss_fn, OPTIMIZERS[opt](), mesh=mesh,
                            reduce=jddp.Buckets(cap_mb=0.01, first_mb=0.005),
                            place=jddp.ZeRO(stage=stage) if stage else jddp.Replicate())
    state, batch = ddp.init(_params()), _batch(mesh)
    calls.clear()
    rep = ddp.report(state, batch)
    text = ddp.step.lower(state, batch).compile().as_text()
    assert "replica_groups=mesh[" in text  # the form this test is about
    assert [(c.kind, c.bytes) for c in rep.collectives] == _compiled_operand_bytes(text, n)
    assert all(c.group_size == n and c.level == "local" for c in rep.collectives)
    assert rep.unknown_groups == () and "unknown" not in str(rep)
    # Ring model: an all-reduce sends 2(n-1)/n of its operand, an all-gather (n-1) operands,
    # a reduce-scatter (n-1)/n of its operand.
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": n - 1, "reduce-scatter": (n - 1) / n}
    assert rep.sent_per_step == pytest.approx(
        sum(factor[c.kind] * c.bytes for c in rep.collectives))
    assert {"all-gather", "all-reduce"} <= {c.kind for c in rep.collectives}
    # The step runs the program the report read.
    state, metrics = ddp.step(state, batch)
    assert len(calls) == 1 and ddp.step.cache_size() == 1
    assert np.isfinite(float(metrics["loss"]))


def test_unknown_replica_groups_are_an_entry_of_the_report_not_an_error():
    """A form of XLA's text the reader does not know (synthetic here): a warning, the collective
    reported with unknown groups (size 0, level "unknown", no bytes sent counted), the rest
    exact."""
    mesh = jddp.data_mesh()
    ddp = jddp.DataParallel(loss_fn, OPTIMIZERS["clip"](), mesh=mesh,
                            reduce=jddp.Buckets(cap_mb=0.01, first_mb=0.005),
                            place=jddp.ZeRO(stage=1))
    state, batch = ddp.init(_params()), _batch(mesh)
    text = ddp.step.lower(state, batch).compile().as_text()
    forms = set(re.findall(r"replica_groups=(mesh\[[^\]]*\] \{[^}]*\})", text))
    assert forms
    odd = text
    for form in forms:
        odd = odd.replace(form, "mesh_v9<<" + form[5:].replace("]", ">>", 1))
    from jddp._src.plan import report as report_lib

    good = report_lib.collectives(text, [0] * mesh.size)
    with pytest.warns(schedule.UnknownReplicaGroupsWarning, match="could not read"):
        bad = report_lib.collectives(odd, [0] * mesh.size)
    assert [c.bytes for c in bad] == [c.bytes for c in good]
    unknown = [c for c in bad if c.level == "unknown"]
    assert unknown and all(c.group_size == 0 and c.sent == 0.0 for c in unknown)
    assert [c for c in bad if c.level != "unknown"] == [
        c for c, b in zip(good, bad, strict=True) if b.level != "unknown"]
    rep = report_lib.Report(bad, None, mesh.size, 1, 1)
    assert rep.unknown_groups == tuple(unknown)
    assert "unknown replica groups" in str(rep) and rep.to_dict()["unknown_groups"] == len(unknown)


_BF16 = jddp.precision.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
_NARROW = {
    "bf16-policy-stage0": dict(precision=_BF16),
    "bf16-policy-stage3": dict(precision=_BF16, place=jddp.ZeRO(stage=3)),
    "bf16-policy-stage3-microbatches": dict(precision=_BF16, place=jddp.ZeRO(stage=3),
                                            accumulate=jddp.Accumulate(microbatches=2)),
    "bf16-reduce-stage2": dict(precision=jddp.precision.MixedPrecision(
        param_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16), place=jddp.ZeRO(stage=2)),
    "bf16-hook-stage0": dict(reduce_hook=jddp.bf16_compress()),
    "fp16-hook-stage2": dict(reduce_hook=jddp.fp16_compress(), place=jddp.ZeRO(stage=2)),
}


@pytest.mark.parametrize("case", sorted(_NARROW))
def test_comm_bytes_are_the_compiled_programs_bytes_with_narrow_dtypes(case):
    """With a bf16 policy or a compressing hook, ``metrics["comm_bytes"]`` is what the compiled
    program sends, equal to ``ddp.report(...).sent_per_step``: XLA:CPU gives its collectives no
    bfloat16 operands (it converts them to float32 around the collective), so on CPU the bf16
    collectives send float32, while float16 ones travel as they are. And every stage-3 gather,
    the backward's re-gathers included, is filed under its bucket, never under ``-``."""
    opts = dict(_NARROW[case])
    hook = opts.pop("reduce_hook", None)
    reduce = jddp.Buckets(cap_mb=0.01, first_mb=0.005, **({"hook": hook} if hook else {}))
    mesh = jddp.data_mesh()
    ddp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=mesh, reduce=reduce, **opts)
    state, batch = ddp.init(_params()), _batch(mesh)
    rep = ddp.report(state, batch)
    _, metrics = ddp.step(state, batch)
    assert rep.sent_per_step == pytest.approx(float(metrics["comm_bytes"]), rel=1e-6)
    dtypes = {d for c in rep.collectives for d in c.dtype.split(",")}
    assert "bf16" not in dtypes  # XLA:CPU's wire (the table in jddp._src.core.bytemodel)
    if case.startswith("fp16"):
        assert "f16" in dtypes
    if "stage3" in case:
        gathers = [c for c in rep.collectives if c.kind == "all-gather"]
        assert len(gathers) > ddp.bucket_plan.num_buckets  # the backward's re-gathers too
        assert all(c.bucket is not None for c in gathers), [c.bucket for c in gathers]
