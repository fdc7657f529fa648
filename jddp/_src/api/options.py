"""The trainer's options: their types, and the one validator of each (clear errors, early)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal, get_args

import jax.numpy as jnp
import numpy as np

from jddp._src.tree import MiB

Chain = Literal["auto", "add", "barrier", "none"]
ModelStateSync = Literal["broadcast", "mean", "none"]
ZeroStage = Literal[0, 1, 2, 3]

CHAIN_MODES: tuple[str, ...] = get_args(Chain)
SYNC_MODES: tuple[str, ...] = get_args(ModelStateSync)

DEFAULT_BUCKET_CAP_MB = 25.0  # PyTorch DDP's bucket_cap_mb
DEFAULT_FIRST_BUCKET_MB = 1.0  # PyTorch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)
DEFAULT_GROUP_SIZE = 8  # examples per group of jddp.Deterministic()


def cap_bytes(mb: Any, name: str, *, unbounded: bool = False) -> int:
    """A cap in MiB as bytes; raises for a cap that is not a positive, finite number
    (``unbounded``: ``math.inf`` is allowed too, one bucket per dtype)."""
    if isinstance(mb, bool):
        raise TypeError(f"{name} must be a number of MiB, got {mb!r}.")
    try:
        value = float(mb)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number of MiB, got {mb!r}.") from None
    if unbounded and value == math.inf:
        return 2**62
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ValueError(
            f"{name} must be a positive, finite number of MiB, got {mb!r}. "
            f"DDP's defaults are {DEFAULT_BUCKET_CAP_MB} MiB buckets after a first one of "
            f"{DEFAULT_FIRST_BUCKET_MB} MiB."
        )
    return max(1, int(value * MiB))


def bucket_caps(bucket_cap_mb: Any = None, first_bucket_mb: Any = None,
                names: tuple[str, str] = ("bucket_cap_mb", "first_bucket_mb")) -> tuple[int, int]:
    """``(cap, first)`` in bytes, by PyTorch DDP's rule (torch 2.13), both valid.

    Neither given: a 1 MiB first bucket, then 25 MiB buckets. ``bucket_cap_mb`` given alone: every
    bucket, the first too, is capped at it (no small first bucket, as DDP does for an explicit
    cap). ``first_bucket_mb`` given: that first bucket, no larger than the cap. ``names``: how
    the two are spelled in messages (``jddp.Buckets``' ``cap_mb`` and ``first_mb``).
    """
    cap_name, first_name = names
    cap = cap_bytes(DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb, cap_name)
    if first_bucket_mb is None:
        return cap, (cap_bytes(DEFAULT_FIRST_BUCKET_MB, "") if bucket_cap_mb is None else cap)
    first = cap_bytes(first_bucket_mb, first_name)
    if first > cap:
        raise ValueError(
            f"{first_name} ({first_bucket_mb}) is larger than {cap_name} ({bucket_cap_mb}); "
            f"the first bucket is meant to be small. Lower {first_name} or raise {cap_name}."
        )
    return cap, first


def renamed_args(fn: str, given: dict[str, Any], old: dict[str, Any],
                 names: dict[str, str], stacklevel: int = 3) -> dict[str, Any]:
    """``given`` (new keyword to value, ``None``: not given) with the old keywords in ``old``
    moved to their new names (``names``: old to new), each with a ``DeprecationWarning`` at the
    caller of ``fn`` (``stacklevel`` frames up from here); an old keyword next to its new one is
    an error."""
    given = dict(given)
    for name, value in old.items():
        if name not in names:
            raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}.")
        new = names[name]
        if value is None:
            continue
        if given[new] is not None:
            raise ValueError(f"{fn}() got {name}= and {new}=: pass {new}= only.")
        warnings.warn(f"{fn}({name}=...) is deprecated: use {new}=... (the same value). The old "
                      "keyword works for one release (docs/migration.md).",
                      DeprecationWarning, stacklevel=stacklevel)
        given[new] = value
    return given


def renamed_caps(fn: str, cap_mb: Any, first_mb: Any, old: dict[str, Any]) -> tuple[int, int]:
    """``(cap, first)`` in bytes from ``jddp.Buckets``' names (``cap_mb``, ``first_mb``), the
    round-3 names in ``old`` (``bucket_cap_mb``, ``first_bucket_mb``) deprecated (see
    :func:`renamed_args`; the same values give the same plan)."""
    caps = renamed_args(fn, {"cap_mb": cap_mb, "first_mb": first_mb}, old,
                        {"bucket_cap_mb": "cap_mb", "first_bucket_mb": "first_mb"}, stacklevel=4)
    return bucket_caps(caps["cap_mb"], caps["first_mb"], ("cap_mb", "first_mb"))


def chain(mode: Any) -> Chain:
    """``mode`` if it is one of :data:`CHAIN_MODES`."""
    if mode not in CHAIN_MODES:
        raise ValueError(
            f"chain must be one of {CHAIN_MODES}, got {mode!r}. 'auto' picks 'barrier' on GPU and "
            "'add' on CPU and TPU; 'none' lets XLA combine the buckets' collectives as it likes."
        )
    return mode


def model_state_sync(mode: Any) -> ModelStateSync:
    """``mode`` if it is one of :data:`SYNC_MODES`."""
    if mode not in SYNC_MODES:
        raise ValueError(
            f"Loss.model_state_sync must be one of {SYNC_MODES}, got {mode!r}. 'broadcast' takes "
            "replica 0's state (DDP's broadcast_buffers), 'mean' averages it (SyncBatchNorm-like "
            "statistics), 'none' keeps one state per replica."
        )
    return mode


def count(value: Any, name: str) -> int:
    """A positive int option (``accumulate_steps``, ``microbatches``)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (1 means no accumulation), got {value}.")
    return int(value)


def float_dtype(dtype: Any, name: str) -> np.dtype | None:
    """``None``, or ``dtype`` as a floating NumPy dtype."""
    if dtype is None:
        return None
    try:
        out = np.dtype(jnp.dtype(dtype))
    except TypeError as e:
        raise TypeError(f"{name} must be a floating dtype, got {dtype!r}.") from e
    if not jnp.issubdtype(out, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {out}.")
    return out


def zero_stage(stage: Any) -> ZeroStage:
    """``stage`` if it is 0-3."""
    if isinstance(stage, bool) or not isinstance(stage, int | np.integer) or stage not in range(4):
        raise ValueError(
            f"zero_stage must be 0, 1, 2 or 3, got {stage!r}: 0 replicates everything (DDP), 1 "
            "shards the optimizer state, 2 also the gradients, 3 also the parameters."
        )
    return int(stage)  # type: ignore[return-value]


def step_sync(sync: Any, accumulate_steps: int | None = None) -> bool | None:
    """The ``sync`` argument of a step: ``None``, ``True`` or ``False`` (static), or a loader's
    ``window_end`` (:class:`jddp.data.WindowEnd`), whose window must be the step's
    ``accumulate_steps`` (when given)."""
    window = getattr(sync, "accumulate_steps", None)
    if window is not None:
        if accumulate_steps is not None and window != accumulate_steps:
            raise ValueError(
                f"sync=loader.window_end comes from a jddp.data.Loader(..., accumulate_steps="
                f"{window}), but this step accumulates over Accumulate(steps={accumulate_steps}) "
                f"calls: the loader would close a window every {window} batches and the step "
                f"would update {'more' if window < accumulate_steps else 'less'} often than "
                f"intended. Build the loader as jddp.data.Loader(..., "
                f"accumulate_steps={accumulate_steps})."
            )
        sync = bool(sync)
    if sync is not None and not isinstance(sync, bool | np.bool_):
        raise TypeError(
            f"sync must be None, True or False (a static Python bool), got {type(sync).__name__}."
        )
    return None if sync is None else bool(sync)


def reshard_after_forward(value: Any, stage: Any, gathers: bool) -> bool | int:
    """``reshard_after_forward``: ``None`` is ``gathers``; a bool or a positive int group size
    (ZeRO++'s hpZ, FSDP2's int) only where the parameters are gathered (``gathers``: stage 3;
    ``stage`` names it in the error). The group size is checked against the mesh by
    :func:`reshard_group`."""
    if value is None:
        return gathers
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        if value < 1:
            raise ValueError(
                f"reshard_after_forward={value!r}: a group size must be a positive int (the "
                "devices the gathered parameters stay sharded over after the forward pass), "
                "or pass True or False."
            )
        value = int(value)
    else:
        flag(value, "reshard_after_forward",
             " An int k keeps the gathered parameters sharded over groups of k devices.")
    if not gathers:
        raise ValueError(
            f"reshard_after_forward={value} applies to jddp.ZeRO(stage=3) only (it frees the "
            f"gathered parameters after the forward pass); stage {stage} gathers no parameters. "
            "Leave it unset, or pass place=jddp.ZeRO(stage=3, ...)."
        )
    return value if isinstance(value, int) and not isinstance(value, bool) else bool(value)


def reshard_group(value: bool | int, shard_count: int, in_host: int | None) -> bool | int:
    """An int ``reshard_after_forward`` checked against the mesh; ``1`` and ``shard_count`` become
    ``False`` and ``True`` (FSDP2's rule), a bool is returned as it is.

    Args:
      value: what :func:`reshard_after_forward` returned.
      shard_count: the devices each split leaf is cut into (the forward gather's group).
      in_host: the devices of a host on a two-level mesh (``None``: a 1-D mesh), which a
        backward gather's group must stay inside.
    """
    if isinstance(value, bool):
        return value
    divisors = [d for d in range(2, shard_count) if shard_count % d == 0
                and (in_host is None or in_host % d == 0)]
    hint = f"pass one of {divisors}" if divisors else "pass True or False"
    if divisors and in_host is not None and in_host < shard_count:
        hint += (f" ({in_host}, the devices per host, keeps every backward gather inside its "
                 "host with the smallest secondary copy)")
    if shard_count % value:
        raise ValueError(
            f"reshard_after_forward={value} must divide the {shard_count} devices the parameters "
            f"are sharded over (each group of {value} holds one copy, split {value} ways): "
            f"{hint}; True gathers over all {shard_count}, False keeps them whole."
        )
    if value == 1 or value == shard_count:
        return value == shard_count
    if in_host is not None and in_host % value:
        raise ValueError(
            f"reshard_after_forward={value}: on this two-level mesh a group of {value} devices "
            f"would span hosts ({in_host} devices per host), so the backward gathers would cross "
            f"the slow link: {hint}."
        )
    return value


def flag(value: Any, name: str, hint: str = "") -> bool:
    """A bool option (``rng``, ``weighted``, ...); anything else is a clear error.

    Every boolean option goes through here: ``bool("no")`` is True, so a truthiness test would
    silently turn ``weighted="no"`` on.
    """
    if not isinstance(value, bool | np.bool_):
        shown = f" {value!r}" if isinstance(value, int | float | str | None) else ""
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}{shown}.{hint}")
    return bool(value)


def metric_names(value: Any, name: str) -> tuple[str, ...]:
    """A tuple of distinct metric names (a single string is one name)."""
    if isinstance(value, str):
        value = (value,)
    try:
        names = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of metric names, got {value!r}.") from None
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"{name} must hold metric names (non-empty str), got {n!r}.")
    if len(set(names)) != len(names):
        raise ValueError(f"{name} names a metric twice: {names}.")
    return names
