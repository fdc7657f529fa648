"""The one table of policy combinations jddp refuses, each with its reason and its fix.

:func:`check` raises the reasons of the :class:`Refusal` rows whose two predicates both hold;
tests/test_matrix.py declares one refused cell per row. A policy's checks of its own fields live
in the policy (:mod:`jddp._src.api.policies`); checks against the data where the data is seen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jddp._src.api.policies import Accumulate, Buckets, Deterministic, Policies, ZeRO
from jddp._src.core.precision import MixedPrecision
from jddp._src.reduce.hooks import CommHook
from jddp._src.reduce.hooks.mean import allreduce_mean
from jddp._src.sync.local_sgd import LocalSGD
from jddp._src.update.loss_scale import DynamicScale


@dataclasses.dataclass(frozen=True)
class Combination:
    """What the table's predicates read: the policies, the precision policy and the mesh."""

    policies: Policies
    precision: MixedPrecision | None = None
    devices: int = 8
    two_level: bool = False


Predicate = Callable[[Combination], bool]


class Refusal(NamedTuple):
    """One refused combination: it is refused when ``a`` and ``b`` both hold."""

    name: str
    a: Predicate
    b: Predicate
    reason: str


def _hook(c: Combination) -> CommHook | None:
    reduce = c.policies.reduce
    return reduce.hook if isinstance(reduce, Buckets) else None


def _power_of_two(k: int) -> bool:
    return k >= 1 and k & (k - 1) == 0


def deterministic(c: Combination) -> bool:
    return isinstance(c.policies.reduce, Deterministic)


def zero(c: Combination) -> bool:
    return isinstance(c.policies.place, ZeRO)


def local_sgd(c: Combination) -> bool:
    return isinstance(c.policies.sync, LocalSGD)


def dynamic_scale(c: Combination) -> bool:
    return isinstance(c.policies.loss_scale, DynamicScale)


def one_level_mesh(c: Combination) -> bool:
    return not c.two_level


def sharded_accumulator(c: Combination) -> bool:
    return c.policies.accumulate.shard is True


def _hook_keeps_state(c: Combination) -> bool:
    """Whether the hook has state or no reduce-scatter (``hook.scatter``), probed on one small
    leaf (the step re-checks with the real parameters)."""
    hook = _hook(c) or allreduce_mean()
    return hook.scatter is None or bool(jax.tree.leaves(
        hook.init(jax.ShapeDtypeStruct((8,), jnp.float32))))


_DET = ("reduce=jddp.Deterministic() sums replicated gradients in one fixed order "
        "(docs/deterministic.md)")
_SHARD = ("Accumulate(shard=True) reduce-scatters every call's gradients into a 1/N "
          "accumulator")

TABLE: tuple[Refusal, ...] = (
    Refusal("deterministic + ZeRO", deterministic, zero,
            f"{_DET}: it does not combine with place=jddp.ZeRO(...) (shard='owner' included: "
            "its per-owner update is not the same bits on every device count). Use "
            "place=jddp.Replicate(), or reduce=jddp.Buckets()."),
    Refusal("deterministic + local SGD", deterministic, local_sgd,
            f"{_DET}: it does not combine with local SGD or DiLoCo (sync=...). Use "
            "sync=jddp.EveryStep(), or reduce=jddp.Buckets()."),
    Refusal("deterministic + loss scale", deterministic, dynamic_scale,
            f"{_DET}: it does not combine with loss_scale=jddp.precision.DynamicScale(). Drop "
            "the loss scale, or use reduce=jddp.Buckets()."),
    Refusal("deterministic + mixed precision", deterministic, lambda c: c.precision is not None,
            f"{_DET} in the master dtype: mixed precision is not supported with the "
            "deterministic reduction (reduce=jddp.Deterministic()). Drop precision=, or use "
            "reduce=jddp.Buckets()."),
    Refusal("deterministic + odd accumulation", deterministic,
            lambda c: not _power_of_two(c.policies.accumulate.steps),
            f"{_DET}: it needs Accumulate(steps=...) to be a power of two "
            "(1, 2, 4, ...), each call's sum being one subtree of the window's tree."),
    Refusal("deterministic + odd device count", deterministic,
            lambda c: not _power_of_two(c.devices),
            f"{_DET}: it needs a power-of-two device count (1, 2, 4, 8, ...), each device "
            "holding one whole subtree. Use a sub-mesh of a power-of-two size."),
    Refusal("local SGD + ZeRO on a 1-D mesh", local_sgd, lambda c: zero(c) and one_level_mesh(c),
            "ZeRO with local SGD (sync=...) shards state inside each replica, but on a 1-D mesh "
            "every device is a replica of its own (nothing to shard over). Build a two-level "
            "mesh, jddp.data_mesh(hosts=...): one replica per host, sharded over its devices."),
    Refusal("hybrid ZeRO on a 1-D mesh",
            lambda c: isinstance(c.policies.place, ZeRO) and c.policies.place.hybrid,
            one_level_mesh,
            "ZeRO(hybrid=True) shards inside each host and needs a two-level "
            "mesh to know what a host is: build it with jddp.data_mesh(hosts=...)."),
    Refusal("offload + local SGD",
            lambda c: isinstance(c.policies.place, ZeRO) and c.policies.place.offload, local_sgd,
            "ZeRO(offload=True) moves the optimizer state between host and device memory "
            "around the update, and local SGD or DiLoCo (sync=...) keep one optimizer state per "
            "replica, updated under vmap, plus DiLoCo's outer state: that placement is not "
            "offloaded. Use ZeRO(offload=False) with local SGD, or sync=jddp.EveryStep()."),
    Refusal("sharded accumulator + stage below 2", sharded_accumulator,
            lambda c: not c.policies.place.splits_grads,
            f"{_SHARD}, but only ZeRO stages 2-3 reduce-scatter gradients. Use "
            "place=jddp.ZeRO(stage=2 or 3), or Accumulate(shard=None)."),
    Refusal("sharded accumulator + stateful hook", sharded_accumulator, _hook_keeps_state,
            f"{_SHARD}, but the hook has state or no reduce-scatter (CommHook.scatter): it "
            "reduces whole buckets. Use Accumulate(shard=None), or a stateless hook."),
    Refusal("sharded accumulator + local SGD", sharded_accumulator, local_sgd,
            f"{_SHARD}, but local SGD and DiLoCo keep their own accumulators. Use "
            "Accumulate(shard=None)."),
    Refusal("narrow reduce_dtype + hook",
            lambda c: c.precision is not None and c.precision.compresses,
            lambda c: _hook(c) is not None,
            "MixedPrecision(reduce_dtype=...) narrower than float32 reduces through the "
            "matching compression hook, and a hook was given too: the hook decides what the "
            "reduction sends. Pass reduce_dtype=None (or float32) with your hook, or drop it."),
    Refusal("float16 without loss scaling",
            lambda c: c.precision is not None and c.precision.uses_float16,
            lambda c: not dynamic_scale(c),
            "MixedPrecision with float16 needs loss scaling: float16 holds magnitudes from "
            "about 6e-5 to 65504 only, so gradients underflow to zero or overflow to Inf. Pass "
            "loss_scale=jddp.precision.DynamicScale(), or use bfloat16 (float32's range)."),
)

ROWS: dict[str, Refusal] = {row.name: row for row in TABLE}


def refusals(c: Combination) -> list[Refusal]:
    """Every row of :data:`TABLE` that refuses ``c`` (empty: the combination is accepted)."""
    return [row for row in TABLE if row.a(c) and row.b(c)]


def check(c: Combination) -> None:
    """Raises a ValueError with the reason of every row that refuses ``c`` (one a line)."""
    refused = refusals(c)
    if refused:
        raise ValueError("\n".join(row.reason for row in refused))


def resolve_shard(accumulate: Accumulate, c: Combination) -> bool:
    """Whether the accumulator is sharded: ``Accumulate.shard``, or for ``None`` whether it
    can be (stage 2-3, a window, a stateless scattering hook, neither local SGD nor the
    deterministic reduction). Call after :func:`check`."""
    if accumulate.shard is not None:
        return accumulate.shard
    return (c.policies.place.splits_grads and accumulate.steps > 1 and not _hook_keeps_state(c)
            and not local_sgd(c) and not deterministic(c))
