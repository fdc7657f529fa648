"""The deprecated spellings: the 0.1.0 keywords of ``DataParallel``, mapped one to one onto the
policies, and the public names that moved to the module that owns them.

An old keyword warns and becomes its policy's field (same bits); next to its new keyword it is an
error. A moved name (:data:`MOVED`) is the same object; reading the old one warns.
"""

from __future__ import annotations

import importlib
import inspect
import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from jddp._src.api import options
from jddp._src.api import policies as pol
from jddp._src.plan import autocap, modelcap
from jddp._src.sync.local_sgd import check_local_sgd


class Owner(NamedTuple):
    """Where an old keyword went: the new keyword, and the policy field (or how to spell it)."""

    keyword: str
    spelling: str
    field: str | None = None


OWNERS: dict[str, Owner] = {
    "bucket_cap_mb": Owner("reduce", "jddp.Buckets(cap_mb=...)", "cap_mb"),
    "first_bucket_mb": Owner("reduce", "jddp.Buckets(first_mb=...)", "first_mb"),
    "hook": Owner("reduce", "jddp.Buckets(hook=...)", "hook"),
    "bucket_plan": Owner("reduce", "jddp.Buckets(plan=...)", "plan"),
    "chain": Owner("reduce", "jddp.Buckets(chain=...)", "chain"),
    "keep_unused": Owner("reduce", "jddp.Buckets(keep_unused=...)", "keep_unused"),
    "deterministic": Owner("reduce", "jddp.Deterministic()"),
    "group_size": Owner("reduce", "jddp.Deterministic(group_size=...)", "group_size"),
    "has_aux": Owner("loss", "jddp.Loss(has_aux=...)", "has_aux"),
    "weighted": Owner("loss", "jddp.Loss(weighted=...)", "weighted"),
    "rng": Owner("loss", "jddp.Loss(rng=...)", "rng"),
    "sum_metrics": Owner("loss", "jddp.Loss(sum_metrics=...)", "sum_metrics"),
    "model_state_sync": Owner("loss", "jddp.Loss(model_state_sync=...)", "model_state_sync"),
    "accumulate_steps": Owner("accumulate", "jddp.Accumulate(steps=...)", "steps"),
    "microbatches": Owner("accumulate", "jddp.Accumulate(microbatches=...)", "microbatches"),
    "accumulator_dtype": Owner("accumulate", "jddp.Accumulate(dtype=...)", "dtype"),
    "accum_dtype": Owner("accumulate", "jddp.Accumulate(dtype=...)", "dtype"),
    "shard_accumulator": Owner("accumulate", "jddp.Accumulate(shard=...)", "shard"),
    "zero_stage": Owner("place", "jddp.ZeRO(stage=...) (stage 0: place=jddp.Replicate())",
                        "stage"),
    "hybrid_shard": Owner("place", "jddp.ZeRO(stage=..., hybrid=...)", "hybrid"),
    "reshard_after_forward": Owner("place", "jddp.ZeRO(stage=3, reshard_after_forward=...)",
                                   "reshard_after_forward"),
    "local_sgd": Owner("sync", "jddp.local_sgd.diloco(...) or post_local_sgd(...) (the same "
                               "value; None: jddp.EveryStep())"),
    "mixed_precision": Owner("precision", "jddp.precision.MixedPrecision(...) (the same value)"),
    "skip_not_finite": Owner("loss_scale", "jddp.SkipNotFinite() (jddp.DynamicScale() skips "
                                           "too)"),
    "skip_nonfinite": Owner("loss_scale", "jddp.SkipNotFinite() (jddp.DynamicScale() skips "
                                          "too)"),
}


class Moved(NamedTuple):
    """Where a public name went: how to spell it now, and the module and name of its object."""

    spelling: str
    module: str
    attr: str


def _home(module: str, name: str) -> Moved:
    return Moved(f"{module}.{name}", module, name)


# (module, old name) -> its new home. jddp's top level keeps what most training scripts use;
# the rest lives in the module that documents it.
MOVED: dict[tuple[str, str], Moved] = {
    ("jddp", "BucketPlan"): _home("jddp.buckets", "BucketPlan"),
    ("jddp", "CommHook"): _home("jddp.hooks", "CommHook"),
    ("jddp", "HookContext"): _home("jddp.hooks", "HookContext"),
    ("jddp", "DynamicScale"): _home("jddp.precision", "DynamicScale"),
    ("jddp", "Evaluator"): _home("jddp.evaluation", "Evaluator"),
    ("jddp", "pad_batch"): _home("jddp.data", "pad_batch"),
    ("jddp", "global_batch_from_local"): _home("jddp.distributed", "global_batch_from_local"),
    ("jddp", "verify_replicas"): _home("jddp.verify", "verify_replicas"),
    # jddp.Replicate is the placement policy; placing a tree is jddp.mesh's.
    ("jddp", "replicate"): _home("jddp.mesh", "replicate_tree"),
    ("jddp.mesh", "replicate"): _home("jddp.mesh", "replicate_tree"),
}


def moved(module: str, name: str) -> Any:
    """The object of ``module``'s moved name ``name`` (for the module's ``__getattr__``), with a
    ``DeprecationWarning`` naming its new spelling at the line that read it; for any other name
    the ``AttributeError`` Python would raise."""
    home = MOVED.get((module, name))
    if home is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} is deprecated: use {home.spelling} (the same object). The "
                  "old name works for one release (docs/migration.md).", DeprecationWarning,
                  stacklevel=3)
    return getattr(importlib.import_module(home.module), home.attr)


def renamed_call(old: str, new: str) -> None:
    """Warns that the function ``old`` is deprecated for ``new`` (at its caller's caller)."""
    warnings.warn(f"{old} is deprecated: use {new}. The old function works for one release "
                  "(docs/migration.md).", DeprecationWarning, stacklevel=3)


def message(old: str) -> str:
    """The deprecation message of ``old``."""
    owner = OWNERS[old]
    return (f"DataParallel({old}=...) is deprecated: use {owner.keyword}={owner.spelling}. "
            f"The old keyword works for one release (docs/migration.md).")


_PACKAGE = str(Path(__file__).resolve().parents[2]) + os.sep  # the jddp/ folder


def _user_stacklevel() -> int:
    """The ``stacklevel`` (counted from :func:`_warn`) of the first caller outside jddp: the
    user's ``DataParallel(...)``, also through ``jddp.nnx.DataParallel`` (Python's default
    filters show a DeprecationWarning only where ``__main__`` triggers it)."""
    frame, level = inspect.currentframe(), 0
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return max(level, 1)


def _warn(old: dict[str, Any]) -> None:
    level = _user_stacklevel()
    for name in old:
        if name not in OWNERS:
            raise TypeError(f"DataParallel() got an unexpected keyword argument {name!r}.")
        warnings.warn(message(name), DeprecationWarning, stacklevel=level)


# Round-3 keywords that took a bool: checked under their own name, before they move.
_FLAGS = ("has_aux", "weighted", "rng", "keep_unused", "deterministic", "hybrid_shard",
          "skip_not_finite", "skip_nonfinite")


# What a non-bool most likely meant (the round-3 messages said it too).
_FLAG_HINTS = {"rng": " Pass the key itself to step(state, batch, rng=key)."}


def _refuse_mixing(old: dict[str, Any], given: dict[str, Any]) -> None:
    for name in old:
        owner = OWNERS[name]
        if given.get(owner.keyword) is not None:
            raise ValueError(
                f"DataParallel got {name}= and {owner.keyword}=, and {name} is now part of "
                f"{owner.keyword}= ({owner.keyword}={owner.spelling}): pass it there and drop "
                f"{name}=."
            )


def _fields(old: dict[str, Any], keyword: str) -> dict[str, Any]:
    return {OWNERS[n].field: v for n, v in old.items()  # type: ignore[misc]
            if OWNERS[n].keyword == keyword and OWNERS[n].field is not None}


def _reduce(old: dict[str, Any]) -> pol.Buckets | pol.Deterministic:
    fields = _fields(old, "reduce")
    group = fields.pop("group_size", None)
    det = options.flag(old.get("deterministic", False), "deterministic",
                       " deterministic=True gives the same bits on any device count; "
                       "group_size=... sets its group size.")
    if not det:
        if group is not None:
            raise ValueError(
                f"group_size={group!r} sets the group size of the deterministic step, but "
                "deterministic=False: pass deterministic=True with it (now "
                "reduce=jddp.Deterministic(group_size=...)), or drop group_size.")
        return pol.Buckets(**fields)
    # The round-3 deterministic step ignored the bucket options (numbers, a plan, the chain,
    # keep_unused): they still are, so old scripts that pass them keep working. It refused a
    # cap to choose and a hook: so does this.
    cap, hook = fields.get("cap_mb"), fields.get("hook")
    if modelcap.resolve(cap) or autocap.resolve(cap):
        raise ValueError(
            f"deterministic=True (now reduce=jddp.Deterministic()) reduces without buckets, so "
            f"bucket_cap_mb={cap!r} has nothing to choose (nothing to tune; it is a field of "
            "jddp.Buckets): drop it, or use deterministic=False.")
    if hook is not None:
        raise ValueError(
            f"deterministic=True (now reduce=jddp.Deterministic()) does not combine with "
            f"hook={getattr(hook, 'name', hook)!r}: the deterministic reduction sums replicated "
            "gradients in one fixed order, with no hook (docs/deterministic.md). Drop hook=, "
            "or use deterministic=False.")
    return pol.Deterministic() if group is None else pol.Deterministic(group_size=group)


def _place(old: dict[str, Any]) -> pol.Replicate | pol.ZeRO:
    fields = _fields(old, "place")
    stage = options.zero_stage(fields.pop("stage", 0))
    if stage:
        return pol.ZeRO(stage=stage, **fields)
    if fields.get("hybrid", False):
        raise ValueError("hybrid_shard=True shards state inside each host, but zero_stage=0 "
                         "shards nothing: pass zero_stage=1, 2 or 3 with it (now "
                         "place=jddp.ZeRO(stage=..., hybrid=True)).")
    options.flag(fields.get("hybrid", False), "hybrid_shard")
    options.reshard_after_forward(fields.get("reshard_after_forward"), 0, False)
    return pol.Replicate()


def _loss_scale(old: dict[str, Any], loss_scale: Any) -> Any:
    skip = False
    for name in ("skip_not_finite", "skip_nonfinite"):
        if name in old:
            skip = options.flag(old[name], "skip_not_finite")
    # A DynamicScale skips non-finite steps itself: skip_not_finite=True next to it changes
    # nothing (either guard skips a non-finite update), so it maps onto the scale.
    return pol.SkipNotFinite() if skip and loss_scale is None else loss_scale


def policies_from_keywords(old: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The new keywords' values after the old keywords in ``old`` (each warns, pointing at the
    user's ``DataParallel(...)`` call).

    Args:
      old: the round-3 keywords given (name to value).
      given: the new keywords given (``None``: not given).
    """
    out = dict(given)
    if not old:
        return out
    _warn(old)
    for name in _FLAGS:
        if name in old:
            options.flag(old[name], name, _FLAG_HINTS.get(name, ""))
    old = {"skip_not_finite" if k == "skip_nonfinite" else
           "accumulator_dtype" if k == "accum_dtype" else k: v for k, v in old.items()}
    _refuse_mixing({k: v for k, v in old.items() if k != "skip_not_finite"}, given)
    keywords = {OWNERS[n].keyword for n in old}
    if "reduce" in keywords:
        out["reduce"] = _reduce(old)
    if "place" in keywords:
        out["place"] = _place(old)
    if "loss" in keywords:
        out["loss"] = pol.Loss(**_fields(old, "loss"))
    if "accumulate" in keywords:
        out["accumulate"] = pol.Accumulate(**_fields(old, "accumulate"))
    if "sync" in keywords:
        sync = check_local_sgd(old["local_sgd"])
        out["sync"] = pol.EveryStep() if sync is None else sync
    if "precision" in keywords:
        out["precision"] = old["mixed_precision"]
    if "loss_scale" in keywords:
        out["loss_scale"] = _loss_scale(old, given.get("loss_scale"))
    return out
