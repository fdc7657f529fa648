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
