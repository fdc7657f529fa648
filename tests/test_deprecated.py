"""The round-3 keywords' own checks: each still validates its value under its old name (and
warns), for the release that keeps them. The spellings' equality is tests/test_policies.py's."""

from __future__ import annotations

import optax
import pytest
from jax.sharding import Mesh

import jddp
from tests._models import mlp_loss


def _old(**kw):
    """``DataParallel`` built with round-3 keywords: it must warn."""
    with pytest.warns(DeprecationWarning, match="is deprecated: use"):
        return jddp.DataParallel(mlp_loss, optax.sgd(0.1), **kw)


def _mesh(n):
    import jax
    import numpy as np
    return Mesh(np.array(jax.devices()[:n]), ("data",))


@pytest.mark.parametrize("kw, match", [
    (dict(deterministic=True, hook=jddp.bf16_compress()), "hook="),
    (dict(deterministic=True, bucket_cap_mb="auto"), "nothing to tune"),
    (dict(group_size=4), "pass deterministic=True with it"),
])
def test_deterministic_keywords_refuse_what_the_policy_cannot_express(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _old(mesh=_mesh(2), **kw)


def test_hybrid_shard_needs_a_sharded_stage():
    with pytest.raises(ValueError, match="zero_stage=1, 2 or 3"):
        _old(mesh=jddp.data_mesh(hosts=2), hybrid_shard=True)
    with pytest.raises(TypeError, match="hybrid_shard must be True or False"):
        _old(mesh=jddp.data_mesh(hosts=2), zero_stage=2, hybrid_shard="yes")


@pytest.mark.parametrize("stage", [4, -1, "3", True, 2.0])
def test_bad_zero_stage_is_named(stage):
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        _old(zero_stage=stage)


def test_deterministic_refuses_a_cap_to_choose():
    with pytest.raises(ValueError, match="bucket_cap_mb='model' has nothing to choose"):
        _old(bucket_cap_mb="model", deterministic=True)


def test_a_key_given_as_rng_points_at_step():
    import jax
    with pytest.raises(TypeError, match=r"rng must be True or False.*step\(state, batch, rng=key\)"):
        _old(rng=jax.random.key(0))


def test_plan_buckets_and_value_and_grad_take_the_buckets_names():
    """cap_mb=/first_mb= (jddp.Buckets' names); the old names warn at the caller, naming the
    new one, and give the same plan and the same bits."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jddp.buckets import make_plan
    from tests._models import mlp_params, regression_batch

    params, batch = mlp_params(0, [8, 32, 32, 4]), regression_batch(0, 16, 8, 4)
    new = jddp.plan_buckets(mlp_loss, params, batch, cap_mb=0.002, first_mb=0.001)
    with pytest.warns(DeprecationWarning, match=r"plan_buckets\((bucket_cap|first_bucket)_mb="
                                                r"\.\.\.\) is deprecated: use (cap|first)_mb=") as rec:
        old = jddp.plan_buckets(mlp_loss, params, batch, bucket_cap_mb=0.002,
                                first_bucket_mb=0.001)
    assert old == new and new.num_buckets > 1
    assert {w.filename for w in rec} == {__file__}
    with pytest.warns(DeprecationWarning, match=r"make_plan\(first_bucket_mb=\.\.\.\)"):
        assert make_plan(params, list(range(6)), first_bucket_mb=0.001, cap_mb=0.002) == \
            make_plan(params, list(range(6)), first_mb=0.001, cap_mb=0.002)
    with pytest.raises(ValueError, match="pass cap_mb= only"):
        jddp.plan_buckets(mlp_loss, params, batch, cap_mb=1.0, bucket_cap_mb=1.0)

    mesh = _mesh(8)

    def grads(**caps):
        fn = jax.shard_map(lambda p, b: jddp.value_and_grad(mlp_loss, "data", **caps)(p, b)[1],
                           mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        return jax.jit(fn)(params, batch)

    want = grads(cap_mb=0.002, first_mb=0.001)
    with pytest.warns(DeprecationWarning, match=r"value_and_grad\((bucket_cap|first_bucket)_mb="):
        got = grads(bucket_cap_mb=0.002, first_bucket_mb=0.001)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jnp.all(jnp.isfinite(jax.tree.leaves(want)[0]))


def test_abstract_state_takes_inits_keyword():
    """abstract_state(params, model_state=...) as init(params, model_state=...); the positional
    form works; params_like=/model_state_like= warn and give the same state."""
    import jax
    import jax.numpy as jnp

    from tests._models import mlp_params

    params = mlp_params(0, [8, 16, 4])
    ms = {"n": jnp.zeros((3,))}
    ddp = jddp.DataParallel(lambda p, s, b: (mlp_loss(p, b), s), optax.sgd(0.1),
                            place=jddp.ZeRO(stage=3))
    new = ddp.abstract_state(params, model_state=ms)
    assert jax.tree.structure(new) == jax.tree.structure(ddp.abstract_state(params, ms))
    assert new.model_state["n"].shape == (3,)
    with pytest.warns(DeprecationWarning, match=r"abstract_state\((params|model_state)_like="
                                                r"\.\.\.\) is deprecated: use (params|model_state)=") as rec:
        old = ddp.abstract_state(params_like=params, model_state_like=ms)
    assert {w.filename for w in rec} == {__file__}
    assert old == new
    with pytest.raises(TypeError, match="missing the parameters"):
        ddp.abstract_state(model_state=ms)


def test_local_sgd_given_the_function_says_to_call_it():
    with pytest.raises(TypeError, match=r"call it: jddp\.local_sgd\.diloco\(period=\.\.\.\)"):
        _old(local_sgd=jddp.local_sgd.diloco)


@pytest.mark.parametrize("name", ["has_aux", "weighted", "keep_unused", "skip_not_finite",
                                  "hybrid_shard", "rng"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_every_round3_flag_takes_only_a_bool(name, value):
    """Checked under its own name before it moves into its policy."""
    with pytest.raises(TypeError, match=rf"{name} must be True or False"):
        _old(**{name: value})


# ------------------------------------------- one spelling per name: what moved, what stays

#: Every top-level spelling of the public contract (shared README §3): never a warning.
_CONTRACT = ("data_mesh", "DataParallel", "value_and_grad", "plan_buckets", "initialize",
             "bf16_compress", "Loss", "Buckets", "Deterministic", "Replicate", "ZeRO",
             "Accumulate", "EveryStep", "hooks", "local_sgd", "precision", "data", "nnx")


def test_the_contract_and_all_names_read_without_a_warning():
    import warnings

    assert len(jddp.__all__) <= 30, jddp.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in (*_CONTRACT, *jddp.__all__):
            assert getattr(jddp, name) is not None, name
        for obj in (jddp.hooks.hierarchical, jddp.hooks.int8_compress, jddp.local_sgd.diloco,
                    jddp.local_sgd.post_local_sgd, jddp.precision.MixedPrecision,
                    jddp.data.Loader, jddp.nnx.DataParallel, jddp.mesh.shard_batch,
                    jddp.mesh.replicate_tree, jddp.data.pad_batch):
            assert callable(obj)
        assert jddp.perf.__name__ == "jddp.perf"  # lazy, not a moved name


def _moved():
    from jddp._src.api.deprecated import MOVED
    return sorted(MOVED.items())


@pytest.mark.parametrize("old, home", _moved(), ids=lambda v: ".".join(v[:2]) if
                         isinstance(v, tuple) and len(v) == 2 else None)
def test_a_moved_name_warns_at_the_caller_and_is_the_same_object(old, home):
    import importlib

    module, name = old
    with pytest.warns(DeprecationWarning, match=rf"^{module}\.{name} is deprecated: use "
                                                rf"{home.spelling} \(the same object\).*"
                                                r"docs/migration\.md") as rec:
        obj = getattr(importlib.import_module(module), name)
    assert obj is getattr(importlib.import_module(home.module), home.attr)
    assert {w.filename for w in rec} == {__file__}
    assert name not in importlib.import_module(module).__all__


def test_from_import_of_a_moved_name_warns():
    with pytest.warns(DeprecationWarning, match=r"jddp\.pad_batch is deprecated: use "
                                                r"jddp\.data\.pad_batch"):
        from jddp import pad_batch
    assert pad_batch is jddp.data.pad_batch
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        jddp.no_such_name  # noqa: B018


def test_replicate_and_shard_global_batch_place_as_their_new_names():
    """jddp.replicate is jddp.mesh.replicate_tree; shard_global_batch (jddp. and
    jddp.distributed.) warns when called and places the same arrays as jddp.shard_batch."""
    import jax
    import numpy as np

    mesh = jddp.data_mesh(hosts=2)
    tree = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}
    batch = {"x": np.arange(32.0, dtype=np.float32).reshape(16, 2), "y": np.arange(16)}
    with pytest.warns(DeprecationWarning, match=r"jddp\.mesh\.replicate_tree"):
        old = jddp.replicate(tree, mesh)
    new = jddp.mesh.replicate_tree(tree, mesh)
    assert old["w"].sharding == new["w"].sharding and old["w"].sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(old["w"]), np.asarray(new["w"]))
    want = jddp.shard_batch(batch, mesh)
    for fn in (jddp.shard_global_batch, jddp.distributed.shard_global_batch):
        with pytest.warns(DeprecationWarning, match=r"jddp\.shard_global_batch\(batch, mesh\) "
                                                    r"is deprecated: use jddp\.shard_batch") as rec:
            got = fn(batch, mesh)
        assert {w.filename for w in rec} == {__file__}
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_lower_takes_inits_names():
    """lower(params, batch, model_state=...); params_like=/batch_like=/model_state_like= warn
    and lower the same program."""
    import jax

    from tests._models import mlp_params, regression_batch

    params, batch = mlp_params(0, [8, 16, 4]), regression_batch(0, 16, 8, 4)
    ms = {"n": jax.numpy.zeros((3,))}
    ddp = jddp.DataParallel(lambda p, s, b: (mlp_loss(p, b), s), optax.sgd(0.1))
    new = ddp.lower(params, batch, model_state=ms).as_text()
    with pytest.warns(DeprecationWarning, match=r"lower\((params|batch|model_state)_like=\.\.\.\) "
                                                r"is deprecated: use (params|batch|model_state)=") \
            as rec:
        old = ddp.lower(params_like=params, batch_like=batch, model_state_like=ms).as_text()
    assert {w.filename for w in rec} == {__file__} and len(rec) == 3
    assert old == new
    with pytest.raises(TypeError, match=r"lower\(params, batch, model_state=None\)"):
        ddp.lower(params)


def test_docs_examples_and_benchmarks_spell_only_the_new_names():
    """No moved name in the docs, examples, benchmarks, scripts, tests or jddp's own text, except
    the migration page and changelog (their tables name the old spellings), the module that maps
    them, and this file."""
    import pathlib
    import re

    from jddp._src.api.deprecated import MOVED

    root = pathlib.Path(__file__).resolve().parent.parent
    old = "|".join(re.escape(f"{module}.{name}") for module, name in MOVED)
    pattern = re.compile(rf"(?<![\w.])({old}|(jddp\.|distributed\.|dist\.)shard_global_batch"
                         r"|(params|batch|model_state)_like=)\b")
    skip = {"docs/migration.md", "docs/changelog.md", "jddp/_src/api/deprecated.py",
            "tests/test_deprecated.py"}
    files = [root / "README.md", *root.glob("docs/**/*.md"),
             *(p for d in ("examples", "benchmarks", "scripts", "tests", "jddp")
               for p in (root / d).rglob("*.py"))]
    bad = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        if rel in skip:
            continue
        text = path.read_text()
        lines = text.splitlines()
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start())
            if "deprecated" not in lines[line].lower():  # the warning's own text
                bad.append(f"{rel}:{line + 1}: {m.group(0)}")
    assert not bad, "old spellings taught as current:\n" + "\n".join(bad)


def test_cost_model_takes_the_buckets_names():
    """``jddp.perf.costmodel``'s caps are ``cap_mb``/``first_mb``; ``bucket_cap_mb``/
    ``first_bucket_mb`` warn at the caller and predict exactly the same."""
    from jddp.perf import costmodel as cm

    prof = cm.ModelProfile.from_sizes([2**20] * 12, backward_s=0.01)
    c = cm.ClusterSpec(16, devices_per_node=8, inter=cm.Link.gbit(25, 10))
    calls = [(cm.simulate_iteration, {}), (cm.overlap_speedup, {}),
             (cm.simulate_strategy, {"strategy": "hierarchical"})]
    for fn, kw in calls:
        want = fn(prof, c, cap_mb=2.0, first_mb=0.5, **kw)
        with pytest.warns(DeprecationWarning, match=rf"{fn.__name__}\((bucket_cap|first_bucket)"
                                                    r"_mb=\.\.\.\) is deprecated") as rec:
            got = fn(prof, c, bucket_cap_mb=2.0, first_bucket_mb=0.5, **kw)
        assert got == want and {w.filename for w in rec} == {__file__}
    with pytest.warns(DeprecationWarning, match=r"advise_bucket_cap\(first_bucket_mb="):
        old = cm.advise_bucket_cap(prof, c, first_bucket_mb=0.5, candidates_mb=(1, 4))
    assert old == cm.advise_bucket_cap(prof, c, first_mb=0.5, candidates_mb=(1, 4))
    with pytest.raises(ValueError, match="pass cap_mb= only"):
        cm.simulate_iteration(prof, c, cap_mb=1.0, bucket_cap_mb=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'cap'"):
        cm.simulate_iteration(prof, c, cap=1.0)
    from jddp.perf import xla_flags

    with pytest.warns(DeprecationWarning, match=r"recommended\(bucket_cap_mb=\.\.\.\)"):
        assert xla_flags.recommended("gpu", bucket_cap_mb=50.0) == xla_flags.recommended(
            "gpu", cap_mb=50.0)
