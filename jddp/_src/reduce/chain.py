"""The chain between buckets: each bucket's gradients take a data dependency on the previous
bucket's reduced result, so XLA's combiners cannot merge the buckets' collectives without flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jddp._src.api import options
from jddp._src.core.collectives import traced_platform
from jddp._src.introspect import vma


def resolve_chain(chain: options.Chain) -> str:
    """The chaining used between buckets; ``"auto"`` is ``"barrier"`` on GPU, ``"add"`` elsewhere.

    ``"add"`` adds an always-zero scalar from the previous bucket's result (the only mode that
    works on CPU, whose pipeline drops barriers; on GPU it is fused into the GEMMs, which then
    wait); ``"barrier"`` uses ``lax.optimization_barrier`` (no arithmetic, so GPU GEMMs overlap);
    ``"none"`` lets XLA combine. Measured in docs/xla_flags.md.
    """
    options.chain(chain)
    if chain != "auto":
        return chain
    return "barrier" if on_gpu() else "add"


def on_gpu() -> bool:
    """Whether the step is traced for a GPU (the platforms XLA:GPU answers to)."""
    return traced_platform() in ("gpu", "cuda", "rocm")


def dep_zeros(chain: str, structs: Sequence[jax.ShapeDtypeStruct], axis_name: Any,
               other: tuple = ()) -> Any:
    """The forward value of a token's dependency part (its cotangent carries the real thing).

    ``"barrier"`` needs the previous bucket's reduced arrays themselves: an optimization barrier
    on a scalar derived from them does not keep XLA's GPU combiner from merging the buckets.
    ``other``: mesh axes the reduced values still vary over (see
    :func:`jddp._src.reduce.backward.bucketed_vjp`).
    """
    if chain == "barrier":
        axes = (*vma.axis_names(axis_name), *other)
        return tuple(vma.to_varying(jnp.zeros(s.shape, s.dtype), axes) for s in structs)
    return vary(jnp.zeros((), jnp.float32), other)


def vary(x: Any, axes: tuple) -> Any:
    return vma.to_varying(x, axes) if axes else x


def local_grads(ct_leaves: tuple, offset: Any, ct_dep: Any, chain: str) -> tuple:
    """The bucket's local gradients: this micro-batch's, plus the offset, chained on the
    previous bucket (see the module docstring)."""
    grads = tuple(ct_leaves)
    if offset:
        grads = tuple(g + o.astype(g.dtype) for g, o in zip(grads, offset, strict=True))
    return chained(grads, ct_dep, chain)


def chained(values: tuple, dep: Any, chain: str) -> tuple:
    """``values`` made to depend on ``dep``, the previous bucket's :func:`chain_dependency`."""
    # JAX emits one collective per leaf and XLA's combiner merges independent ones, so every
    # leaf needs the dependency: a scalar carried alongside would not keep the leaves apart.
    if chain == "add":
        return tuple(v + dep.astype(v.dtype) for v in values)
    if chain == "barrier" and values and dep:
        values, _ = lax.optimization_barrier((values, dep))
    return tuple(values)


def dep_cotangent(dep: Any, token_dep: Any, chain: str, axis_name: Any) -> Any:
    """The token's cotangent: what the next bucket in backward order waits for."""
    if chain == "barrier":
        return tuple(vma.to_varying(r, axis_name) for r in dep)
    return vma.like(dep.astype(jnp.result_type(token_dep)), token_dep, axis_name)
