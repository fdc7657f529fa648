"""A mixed-precision policy (FSDP2's ``MixedPrecisionPolicy``): ``DataParallel(precision=
MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32))``.

Master parameters and optimizer state stay float32; the loss computes with ``param_dtype``
copies (:class:`Cast` wraps the step's reducer; stage 3 gathers ``param_dtype`` pieces);
gradients are reduced in float32, or with a narrower ``reduce_dtype`` through the matching
compression hook; float16 needs ``DynamicScale()`` (docs/precision.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp._src.api import options


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy (see the module docstring).

    Attributes:
      param_dtype: the dtype forward and backward compute with (the stage-3 gathers carry it);
        ``None``: the master dtype (no cast).
      reduce_dtype: the dtype gradients are reduced in; ``None`` or float32: float32. bfloat16 or
        float16: the matching compression hook.
    """

    param_dtype: Any = jnp.bfloat16
    reduce_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype",
                           options.float_dtype(self.param_dtype, "MixedPrecision(param_dtype=...)"))
        object.__setattr__(self, "reduce_dtype", options.float_dtype(
            self.reduce_dtype, "MixedPrecision(reduce_dtype=...)"))
        for name in ("param_dtype", "reduce_dtype"):
            d = getattr(self, name)
            if d is not None and d.itemsize > 4:
                raise ValueError(f"MixedPrecision({name}={d}) is wider than the float32 master "
                                 "parameters; mixed precision computes in a narrower dtype.")

    @property
    def uses_float16(self) -> bool:
        return np.dtype(np.float16) in (self.param_dtype, self.reduce_dtype)

    @property
    def compresses(self) -> bool:
        """Whether gradients are reduced in a dtype narrower than float32 (by a hook)."""
        return self.reduce_dtype is not None and self.reduce_dtype.itemsize < 4


def check_policy(value: Any) -> MixedPrecision | None:
    """``value`` if it is ``None`` or a :class:`MixedPrecision`; a clear error otherwise."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    raise TypeError(
        f"precision= must be a jddp.precision.MixedPrecision (or None), got "
        f"{type(value).__name__} {value!r}; e.g. MixedPrecision(param_dtype=jnp.bfloat16, "
        "reduce_dtype=jnp.float32)."
    )


def resolve_hook(policy: MixedPrecision | None, hook: Any) -> Any:
    """The hook of a step with ``policy`` (``hook``: the user's, or ``None``): the matching
    compression hook for a narrow ``reduce_dtype``. The combinations this refuses (a narrow
    ``reduce_dtype`` next to a user's hook, float16 without a loss scale) are rows of
    :mod:`jddp._src.step.compat`, checked before."""
    if policy is None or not policy.compresses or hook is not None:
        return hook
    from jddp._src.reduce.hooks.cast import bf16_compress, fp16_compress  # a leaf: no cycle

    return bf16_compress() if policy.reduce_dtype == np.dtype(jnp.bfloat16) else fp16_compress()


def check_master(policy: MixedPrecision | None, params: Any) -> None:
    """Raises unless every parameter leaf is float32 when a policy is given (the policy's
    master copy: a bfloat16 master would lose the small updates mixed precision keeps)."""
    if policy is None:
        return
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    bad = [(jax.tree_util.keystr(p), jnp.result_type(x)) for p, x in paths
           if jnp.result_type(x) != np.float32]
    if bad:
        shown = ", ".join(f"{k}: {d}" for k, d in bad[:3])
        raise TypeError(
            f"precision=MixedPrecision(...) keeps float32 master parameters, but {len(bad)} "
            "leaves are not "
            f"float32 ({shown}). Pass float32 params to init(); the policy casts them to "
            f"param_dtype={policy.param_dtype} for compute."
        )


def compute_params(policy: MixedPrecision | None, params: Any) -> Any:
    """``params`` (arrays or shape structs) as the loss computes with them: ``param_dtype``."""
    if policy is None or policy.param_dtype is None:
        return params
    dtype = policy.param_dtype

    def cast(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype)
        return x.astype(dtype)

    return jax.tree.map(cast, params)


class Wrapper:
    """A reducer around another (``inner``): what it does not define itself is ``inner``'s."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":  # copy probes; not yet set
            raise AttributeError(name)
        return getattr(self.inner, name)


@dataclasses.dataclass(frozen=True)
class Cast(Wrapper):
    """A reducer (:class:`jddp._src.reduce.allreduce.BucketReducer`) whose forward hands the loss
    ``dtype`` copies of the bucket's parameters; everything else is ``inner``'s (the backward
    gets gradients already in the master dtype: :func:`jddp._src.reduce.backward._bucket_vjp` sums
    local gradients in the dtype of the reduction's result)."""

    inner: Any
    dtype: np.dtype

    def forward(self, b: int, leaves: tuple) -> tuple:
        return tuple(x.astype(self.dtype) for x in self.inner.forward(b, leaves))

    def unused(self, i: int, leaf: jax.Array) -> jax.Array:
        return self.inner.unused(i, leaf).astype(self.dtype)


def wrap_reducer(reducer: Any, policy: MixedPrecision | None) -> Any:
    """``reducer`` under ``policy`` (itself without one)."""
    if policy is None or policy.param_dtype is None:
        return reducer
    return Cast(reducer, policy.param_dtype)


def unscale(grads: Any, scale: jax.Array) -> Any:
    """``grads / scale`` (the loss scale taken out of reduced gradients), computed in float32 (a
    float16 leaf could not even hold the scale)."""
    return jax.tree.map(
        lambda g: (g.astype(jnp.promote_types(g.dtype, jnp.float32)) / scale).astype(g.dtype),
        grads,
    )
