"""The step's policies (``jddp.Loss``, ``jddp.Buckets``, ``jddp.ZeRO``, ...): frozen, hashable,
validated at construction; every round-3 keyword of ``DataParallel`` warns, names its new
spelling and gives the same bits as that spelling."""

import dataclasses
import inspect
import os
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

import jddp
from jddp._src.api import deprecated
from jddp._src.reduce.reducers import Bucketed
from jddp._src.step.state import GuardState
from jddp._src.update.nonfinite import Guard
from jddp._src.update.update import Update

D_IN, D_HID, D_OUT, BATCH = 6, 16, 3, 64


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"l1": {"w": jax.random.normal(k1, (D_IN, D_HID)) * 0.3, "b": jnp.zeros((D_HID,))},
            "l2": {"w": jax.random.normal(k2, (D_HID, D_OUT)) * 0.3, "b": jnp.zeros((D_OUT,))}}


def _predict(p, x):
    return jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"]


def _per_example(p, b):
    return jnp.mean((_predict(p, b["x"]) - b["y"]) ** 2, axis=-1)


LOSSES = {
    "plain": lambda p, b: jnp.mean(_per_example(p, b)),
    "aux": lambda p, b: (jnp.mean(_per_example(p, b)), {"n": jnp.float32(b["x"].shape[0])}),
    "weighted": _per_example,
    "rng": lambda p, b, rng: jnp.mean(
        _per_example(p, b) * jax.vmap(lambda k: jax.random.uniform(k, ()))(rng)),
    "state": lambda p, s, b: (jnp.mean(_per_example(p, b)),
                              {"m": 0.9 * s["m"] + 0.1 * jnp.mean(b["x"], 0)}),
}


def _batch(i):
    r = np.random.RandomState(100 + i)
    return {"x": jnp.asarray(r.randn(BATCH, D_IN), jnp.float32),
            "y": jnp.asarray(r.randn(BATCH, D_OUT), jnp.float32)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One round-3 keyword: ``old`` and ``new`` build the same step (the warning checked is
    ``keyword``'s); ``loss`` names the loss form, ``mesh`` is ``"1d"`` or ``"2l"``."""

    keyword: str
    old: dict
    new: dict
    loss: str = "plain"
    mesh: str = "1d"
    needs: str = ""  # "plan": a fixed plan; "fma_free": the deterministic environment check


def _cases() -> list[Case]:
    mp = jddp.precision.MixedPrecision(param_dtype=jnp.bfloat16)
    post = jddp.local_sgd.post_local_sgd(2)
    scale = jddp.precision.DynamicScale()
    bf16 = jddp.bf16_compress()
    return [
        Case("bucket_cap_mb", {"bucket_cap_mb": 0.001}, {"reduce": jddp.Buckets(cap_mb=0.001)}),
        Case("first_bucket_mb", {"first_bucket_mb": 0.0005},
             {"reduce": jddp.Buckets(first_mb=0.0005)}),
        Case("hook", {"hook": bf16}, {"reduce": jddp.Buckets(hook=bf16)}),
        Case("bucket_plan", {"bucket_plan": "PLAN"}, {"reduce": "PLAN"}, needs="plan"),
        Case("chain", {"chain": "barrier"}, {"reduce": jddp.Buckets(chain="barrier")}),
        Case("keep_unused", {"keep_unused": True}, {"reduce": jddp.Buckets(keep_unused=True)}),
        Case("deterministic", {"deterministic": True}, {"reduce": jddp.Deterministic()},
             needs="fma_free"),
        Case("group_size", {"deterministic": True, "group_size": 4},
             {"reduce": jddp.Deterministic(group_size=4)}, needs="fma_free"),
        Case("has_aux", {"has_aux": True}, {"loss": jddp.Loss(has_aux=True)}, loss="aux"),
        Case("weighted", {"weighted": True}, {"loss": jddp.Loss(weighted=True)},
             loss="weighted"),
        Case("rng", {"rng": True}, {"loss": jddp.Loss(rng=True)}, loss="rng"),
        Case("sum_metrics", {"has_aux": True, "sum_metrics": ("n",)},
             {"loss": jddp.Loss(has_aux=True, sum_metrics=("n",))}, loss="aux"),
        Case("model_state_sync", {"model_state_sync": "mean"},
             {"loss": jddp.Loss(model_state_sync="mean")}, loss="state"),
        Case("accumulate_steps", {"accumulate_steps": 2}, {"accumulate": jddp.Accumulate(steps=2)}),
        Case("microbatches", {"microbatches": 2}, {"accumulate": jddp.Accumulate(microbatches=2)}),
        Case("accumulator_dtype", {"accumulate_steps": 2, "accumulator_dtype": jnp.float32},
             {"accumulate": jddp.Accumulate(steps=2, dtype=jnp.float32)}),
        Case("accum_dtype", {"accumulate_steps": 2, "accum_dtype": jnp.float32},
             {"accumulate": jddp.Accumulate(steps=2, dtype=jnp.float32)}),
        Case("shard_accumulator",
             {"zero_stage": 2, "accumulate_steps": 2, "shard_accumulator": False},
             {"place": jddp.ZeRO(stage=2), "accumulate": jddp.Accumulate(steps=2, shard=False)}),
        Case("zero_stage", {"zero_stage": 3}, {"place": jddp.ZeRO(stage=3)}),
        Case("zero_stage", {"zero_stage": 0}, {"place": jddp.Replicate()}),
        Case("hybrid_shard", {"zero_stage": 2, "hybrid_shard": True},
             {"place": jddp.ZeRO(stage=2, hybrid=True)}, mesh="2l"),
        Case("reshard_after_forward", {"zero_stage": 3, "reshard_after_forward": 4},
             {"place": jddp.ZeRO(stage=3, reshard_after_forward=4)}),
        Case("local_sgd", {"local_sgd": post}, {"sync": post}),
        Case("mixed_precision", {"mixed_precision": mp}, {"precision": mp}),
        Case("skip_not_finite", {"skip_not_finite": True}, {"loss_scale": jddp.SkipNotFinite()}),
        Case("skip_nonfinite", {"skip_nonfinite": True}, {"loss_scale": jddp.SkipNotFinite()}),
        Case("skip_not_finite", {"skip_not_finite": True, "loss_scale": scale},
             {"loss_scale": scale}),
    ]


CASES = _cases()


def _mesh(kind):
    return jddp.data_mesh() if kind == "1d" else jddp.data_mesh(hosts=2)


def _train(case: Case, kwargs: dict, steps: int = 3):
    mesh = _mesh(case.mesh)
    ddp = jddp.DataParallel(LOSSES[case.loss], optax.adam(1e-2), mesh=mesh, donate=False,
                            **kwargs)
    state = (ddp.init(_params(), {"m": jnp.zeros((D_IN,))}) if case.loss == "state"
             else ddp.init(_params()))
    for i in range(steps):
        b = _batch(i)
        mask = (jnp.arange(BATCH) % 3 != 0).astype(jnp.float32) if case.loss == "weighted" \
            else None
        kw = {"rng": jax.random.PRNGKey(i)} if case.loss == "rng" else {}
        state, _ = ddp.step(state, b, mask, **kw)
    return ddp, jax.tree.map(np.asarray, ddp.global_params(state))


def _resolve_plan(case: Case) -> Case:
    if case.needs != "plan":
        return case
    plan = jddp.DataParallel(LOSSES["plain"], optax.adam(1e-2),
                             reduce=jddp.Buckets(cap_mb=0.001)).plan(_params(), _batch(0))
    return dataclasses.replace(case, old={"bucket_plan": plan},
                               new={"reduce": jddp.Buckets(plan=plan)})


@pytest.mark.parametrize("case", CASES, ids=[f"{c.keyword}-{i}" for i, c in enumerate(CASES)])
def test_round3_keyword_warns_and_gives_the_same_bits(case, monkeypatch):
    """The old keyword warns (naming the policy that owns it), builds the same policies as the
    new spelling, and trains to bitwise the same parameters."""
    if case.needs == "fma_free":
        jax.devices()
        monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX")
    case = _resolve_plan(case)
    owner = deprecated.OWNERS[case.keyword]
    want = re.escape(f"DataParallel({case.keyword}=...) is deprecated: use {owner.keyword}=")
    with pytest.warns(DeprecationWarning) as record:  # every old keyword of the case warns
        old_ddp, old = _train(case, case.old)
    named = [w for w in record if re.search(want, str(w.message))]
    assert named and named[0].filename == __file__  # points at the user's call
    assert owner.spelling.split("(")[0] in str(named[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new spelling does not warn
        new_ddp, new = _train(case, case.new)
    assert old_ddp.policies == new_ddp.policies
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        np.testing.assert_array_equal(a, b)
    start = jax.tree.leaves(jax.tree.map(np.asarray, _params()))
    assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(old), start, strict=True))


def test_every_round3_keyword_has_a_case():
    """Each of the 23 round-3 keywords that moved into a policy (and the two older aliases) is
    tested above; the other five (mesh, loss_scale, donate, compiler_options, verify_every)
    are keywords still."""
    assert {c.keyword for c in CASES} == set(deprecated.OWNERS)
    assert len(deprecated.OWNERS) == 23 + 2


def test_data_parallel_takes_at_most_12_keywords():
    sig = inspect.signature(jddp.DataParallel)
    named = [p for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in named] == [
        "mesh", "loss", "reduce", "place", "accumulate", "sync", "precision", "loss_scale",
        "donate", "compiler_options", "verify_every"]


@pytest.mark.parametrize("old, new, owner", [
    ({"bucket_cap_mb": 8.0}, {"reduce": jddp.Buckets()}, "reduce"),
    ({"deterministic": True}, {"reduce": jddp.Buckets()}, "reduce"),
    ({"zero_stage": 2}, {"place": jddp.ZeRO(stage=2)}, "place"),
    ({"has_aux": True}, {"loss": jddp.Loss()}, "loss"),
    ({"accumulate_steps": 2}, {"accumulate": jddp.Accumulate()}, "accumulate"),
    ({"local_sgd": None}, {"sync": jddp.EveryStep()}, "sync"),
    ({"mixed_precision": None}, {"precision": jddp.precision.MixedPrecision()}, "precision"),
])
def test_an_old_keyword_next_to_its_policy_is_an_error(old, new, owner):
    with pytest.raises(ValueError, match=rf"got {list(old)[0]}= and {owner}=.*drop "
                                         rf"{list(old)[0]}="), pytest.warns(DeprecationWarning):
        jddp.DataParallel(LOSSES["plain"], optax.sgd(0.1), **old, **new)


def test_round3_deterministic_still_ignores_the_bucket_numbers(monkeypatch):
    """Round 3's deterministic step ignored numeric caps, a fixed plan, the chain and
    keep_unused (examples/train_digits.py passes its --bucket-cap-mb default): accepted still,
    the same step as reduce=jddp.Deterministic(); a cap to choose or a hook is refused."""
    jax.devices()
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_max_isa=AVX")
    with pytest.warns(DeprecationWarning):
        ddp = jddp.DataParallel(LOSSES["plain"], optax.sgd(0.1), deterministic=True,
                                bucket_cap_mb=25.0, first_bucket_mb=1.0, chain="add",
                                keep_unused=True)
    assert ddp.policies.reduce == jddp.Deterministic()
    with pytest.raises(ValueError, match="has nothing to choose"), \
            pytest.warns(DeprecationWarning):
        jddp.DataParallel(LOSSES["plain"], optax.sgd(0.1), deterministic=True,
                          bucket_cap_mb="model")
    with pytest.raises(ValueError, match="does not combine with hook='bf16_compress'"), \
            pytest.warns(DeprecationWarning):
        jddp.DataParallel(LOSSES["plain"], optax.sgd(0.1), deterministic=True,
                          hook=jddp.bf16_compress())


def test_the_warning_points_at_the_users_call_through_nnx():
    from flax import nnx

    model = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
    with pytest.warns(DeprecationWarning, match=r"accumulate_steps=\.\.\.\) is deprecated") as rec:
        jddp.nnx.DataParallel(model, optax.sgd(0.1),
                              lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                              accumulate_steps=2)
    assert [w.filename for w in rec if "deprecated" in str(w.message)] == [__file__]


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_cap'"):
        jddp.DataParallel(LOSSES["plain"], optax.sgd(0.1), bucket_cap=8.0)


POLICIES = [jddp.Loss(), jddp.Loss(has_aux=True, sum_metrics=["n"]), jddp.Buckets(),
            jddp.Buckets(cap_mb=8.0, first_mb=1.0, hook=jddp.bf16_compress()),
            jddp.Buckets(cap_mb="model"), jddp.Deterministic(group_size=4), jddp.Replicate(),
            jddp.ZeRO(stage=3, reshard_after_forward=4, hybrid=True), jddp.ZeRO(stage=1),
            jddp.Accumulate(steps=4, microbatches=2, dtype=jnp.float32), jddp.EveryStep(),
            jddp.SkipNotFinite(), jddp.precision.DynamicScale(), jddp.local_sgd.diloco(4)]


@pytest.mark.parametrize("policy", POLICIES, ids=[type(p).__name__ for p in POLICIES])
def test_policies_are_frozen_and_hashable(policy):
    assert hash(policy) == hash(dataclasses.replace(policy))
    assert policy == dataclasses.replace(policy)
    field = dataclasses.fields(policy)[0].name if dataclasses.fields(policy) else "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(policy, field, None)


def test_policies_normalise_their_fields():
    assert jddp.Loss(has_aux=True, sum_metrics="n").sum_metrics == ("n",)
    assert jddp.ZeRO(stage=3).resharding() is True  # FSDP's default
    assert jddp.ZeRO(stage=2).resharding() is False
    assert jddp.Accumulate(dtype="float32").dtype == np.dtype(np.float32)
    assert jddp.Buckets(cap_mb=2.0).caps() == (2 * 2**20, 2 * 2**20)
    assert jddp.Buckets().caps() == (25 * 2**20, 2**20)  # DDP's defaults


@pytest.mark.parametrize("build, error, match", [
    (lambda: jddp.Loss(sum_metrics=("n",)), ValueError, r"has_aux=False.*Loss\(has_aux=True"),
    (lambda: jddp.Loss(weighted="yes"), TypeError, "Loss.weighted must be True or False"),
    (lambda: jddp.Loss(model_state_sync="avg"), ValueError, "model_state_sync must be one of"),
    (lambda: jddp.Buckets(cap_mb=-1), ValueError, "Buckets.cap_mb must be a positive, finite"),
    (lambda: jddp.Buckets(cap_mb=1.0, first_mb=2.0), ValueError,
     r"Buckets.first_mb \(2.0\) is larger than Buckets.cap_mb"),
    (lambda: jddp.Buckets(cap_mb="model", first_mb=1.0), ValueError, "first bucket too"),
    (lambda: jddp.Buckets(hook=jddp.bf16_compress), TypeError, "call it"),
    (lambda: jddp.Buckets(plan="p"), TypeError, "Buckets.plan must be a jddp.buckets.BucketPlan"),
    (lambda: jddp.Buckets(chain="fast"), ValueError, "chain must be one of"),
    (lambda: jddp.Deterministic(group_size=0), ValueError, "Deterministic.group_size"),
    (lambda: jddp.ZeRO(stage=0), ValueError, r"place=jddp.Replicate\(\)"),
    (lambda: jddp.ZeRO(stage=2, reshard_after_forward=True), ValueError, r"jddp\.ZeRO\(stage=3\) only"),
    (lambda: jddp.ZeRO(stage=3, reshard_after_forward=0), ValueError, "positive int"),
    (lambda: jddp.ZeRO(offload=1), TypeError, "ZeRO.offload must be True or False"),
    (lambda: jddp.Accumulate(steps=0), ValueError, "Accumulate.steps must be >= 1"),
    (lambda: jddp.Accumulate(microbatches=1.5), TypeError, "Accumulate.microbatches"),
    (lambda: jddp.Accumulate(dtype=jnp.int32), TypeError, "Accumulate.dtype"),
    (lambda: jddp.Accumulate(shard=True), ValueError, "steps=1"),
])
def test_policies_refuse_bad_fields_at_construction(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize("keyword, value, match", [
    ("reduce", jddp.Buckets, r"reduce must be a jddp.Buckets.*Buckets itself \(call it"),
    ("place", jddp.Buckets(), r"place must be a jddp.Replicate\(\) or jddp.ZeRO"),
    ("loss", {"has_aux": True}, r"loss must be a jddp.Loss"),
    ("sync", jddp.local_sgd.diloco, r"diloco itself \(call it"),
    ("loss_scale", True, r"loss_scale must be a jddp.precision.DynamicScale"),
    ("accumulate", 4, r"accumulate must be a jddp.Accumulate"),
])
def test_a_keyword_given_the_wrong_policy_names_what_it_takes(keyword, value, match):
    with pytest.raises(TypeError, match=match):
        jddp.DataParallel(LOSSES["plain"], optax.sgd(0.1), **{keyword: value})


def test_defaults_are_the_plain_policies():
    ddp = jddp.DataParallel(LOSSES["plain"], optax.sgd(0.1))
    assert ddp.policies == jddp._src.api.policies.Policies()
    assert ddp.policies.reduce == jddp.Buckets() and ddp.policies.place == jddp.Replicate()
    assert ddp.policies.sync == jddp.EveryStep() and ddp.policies.loss_scale is None


def test_nnx_takes_the_loss_policy():
    from flax import nnx

    model = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))

    def loss(m, b):
        return jnp.mean((m(b["x"]) - b["y"]) ** 2), {"n": jnp.float32(b["x"].shape[0])}

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ddp = jddp.nnx.DataParallel(model, optax.sgd(0.1), loss,
                                    loss=jddp.Loss(has_aux=True, sum_metrics=("n",)))
        state = ddp.init(model)
        _, metrics = ddp.step(state, _batch(0))
    assert float(metrics["n"]) == BATCH
    with pytest.raises(ValueError, match="pass loss=jddp.Loss\\(has_aux=True"):
        jddp.nnx.DataParallel(model, optax.sgd(0.1), loss, has_aux=True, loss=jddp.Loss())


@pytest.mark.parametrize("sync", ["every_step", "diloco"])
def test_the_documented_example_builds_and_trains(sync):
    """docs/migration.md's example (issue 36's spelling, every policy at once) builds, and a
    window of its step trains (two hosts x 4 devices, ZeRO-3 hybrid with hpZ groups of 4)."""
    def loss_fn(p, b, rng):
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.9, ()))(rng)
        per = _per_example(p, b) * keep
        return per, {"tokens": jnp.sum(jnp.ones_like(per))}

    ddp = jddp.DataParallel(
        loss_fn, optax.adamw(1e-3), mesh=jddp.data_mesh(hosts=2),
        loss=jddp.Loss(has_aux=True, weighted=True, rng=True, sum_metrics=("tokens",)),
        reduce=jddp.Buckets(cap_mb=25, first_mb=1, hook=jddp.bf16_compress()),
        place=jddp.ZeRO(stage=3, reshard_after_forward=4, hybrid=sync == "every_step"),
        accumulate=jddp.Accumulate(steps=2, microbatches=2),
        sync=jddp.EveryStep() if sync == "every_step" else jddp.local_sgd.diloco(period=2),
        precision=jddp.precision.MixedPrecision(param_dtype=jnp.bfloat16),
        loss_scale=jddp.precision.DynamicScale(), donate=True, compiler_options=None,
        verify_every=None)
    state = ddp.init(_params())
    for i in range(4):  # two windows; DiLoCo's period ends on the last (its loss is global)
        state, metrics = ddp.step(state, _batch(i), jnp.ones((BATCH,)),
                                  rng=jax.random.PRNGKey(i))
    assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))
    assert float(metrics["tokens"]) == BATCH


@dataclasses.dataclass(frozen=True)
class _OwnReducer(Bucketed):
    """A reducer outside jddp's policy list (on ``BaseReducer``, through ``Bucketed``)."""


@dataclasses.dataclass(frozen=True)
class _OwnSync(jddp.EveryStep):
    """A sync policy defined outside jddp's own policy list (on EveryStep's defaults)."""


def test_a_new_reducer_or_sync_policy_needs_no_registration():
    """The design's recipes: a reducer on ``BaseReducer`` or a sync policy on ``EveryStep`` is
    taken by ``reduce=``/``sync=`` as it is and runs the step its base runs, bit for bit."""
    mesh = jddp.data_mesh()

    def run(**pols):
        ddp = jddp.DataParallel(LOSSES["plain"], optax.adam(1e-2), mesh=mesh, donate=False,
                                **pols)
        state = ddp.init(_params())
        for i in range(2):
            state, _ = ddp.step(state, _batch(i))
        return jax.tree.leaves(state.params)

    for base, own in [(dict(reduce=jddp.Buckets(cap_mb=25.0, first_mb=1.0)),
                       dict(reduce=_OwnReducer())),
                      (dict(sync=jddp.EveryStep()), dict(sync=_OwnSync()))]:
        for a, b in zip(run(**base), run(**own), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@struct.dataclass
class _SkipCount(GuardState):
    """The state node of a guard defined outside jddp: how many updates it skipped."""

    skipped: jax.Array
    inner: Any = None


@dataclasses.dataclass(frozen=True)
class _SkipLarge(Guard):
    """An update guard defined outside jddp (the design's recipe: one class and its state node):
    skip a step whose reduced gradients' global norm exceeds ``limit``, counting the skips."""

    limit: float = 1e9
    node = _SkipCount

    def init(self) -> _SkipCount:
        return _SkipCount(skipped=jnp.zeros((), jnp.int32))

    def keeps(self, grads: Any) -> jax.Array:
        return optax.tree.norm(grads) <= self.limit

    def update(self, node: _SkipCount, finite: jax.Array) -> _SkipCount:
        return node.replace(skipped=node.skipped + jnp.where(finite, 0, 1).astype(jnp.int32))


@pytest.mark.parametrize("accumulate", [None, jddp.Accumulate(steps=2)])
def test_a_new_update_guard_needs_no_registration(accumulate):
    """A guard on ``Guard`` with its own state node is taken by ``loss_scale=`` as it is: its
    node nests in ``update_state`` (inside the window's), it decides every synchronising call,
    and a guard that keeps every step runs SkipNotFinite's bits."""
    mesh = jddp.data_mesh()
    pols = {} if accumulate is None else {"accumulate": accumulate}

    def run(guard, calls=4):
        ddp = jddp.DataParallel(LOSSES["plain"], optax.adam(1e-2), mesh=mesh, donate=False,
                                loss_scale=guard, **pols)
        state = ddp.init(_params())
        skipped = []
        for i in range(calls):
            state, metrics = ddp.step(state, _batch(i))
            skipped.append(float(metrics["skipped"]))
        return state, skipped

    windows = 4 if accumulate is None else 2
    base, _ = run(jddp.SkipNotFinite())
    keep, kept = run(_SkipLarge())
    for a, b in zip(jax.tree.leaves(base.params), jax.tree.leaves(keep.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    node = Update.guard_state(keep.update_state)
    assert isinstance(node, _SkipCount) and int(node.skipped) == 0 and sum(kept) == 0
    skip, skips = run(_SkipLarge(limit=0.0))
    assert int(Update.guard_state(skip.update_state).skipped) == windows
    assert sum(skips) == windows and int(skip.step) == 0
    for a, b in zip(jax.tree.leaves(_params()), jax.tree.leaves(skip.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
