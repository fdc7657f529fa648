"""Which placement arranged a checkpoint's sharded accumulator: owner sharding's owner rows or
even sharding's even pieces, which have the same shapes. `jddp.checkpoint.save` records it with
each step; `restore` refuses a checkpoint saved mid-window into the other placement."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jddp._src.place import owner_state
from jddp._src.step.state import AccumState, own

__all__ = ["KEY", "check", "of", "saved"]

# The step's custom metadata key naming the placement that saved it (see check).
KEY = "jddp_placement"


def of(state: Any) -> str:
    """``"owner"`` when ``state`` holds owner sharding's packed optimizer state (its sharded
    accumulator's pieces are then arranged in owner rows), else ``"even"`` (even pieces)."""
    leaves = jax.tree.leaves(state, is_leaf=owner_state.is_packed)
    return "owner" if any(owner_state.is_packed(x) for x in leaves) else "even"


def saved(mngr: Any, step: int) -> str:
    """The placement ``jddp.checkpoint.save`` recorded with ``step``; ``"even"`` for checkpoints
    saved without it."""
    try:
        custom = mngr.metadata(step).custom_metadata
    except (AttributeError, FileNotFoundError, ValueError):  # another manager, or none recorded
        return "even"
    return str((custom or {}).get(KEY, "even"))


def _sharded_accumulator(target: Any) -> bool:
    """Whether ``target`` accumulates into a sharded accumulator: gradient sums shaped like the
    parameters (a per-device one has a leading device dimension)."""
    acc = own(getattr(target, "update_state", None), AccumState)
    if acc is None or not hasattr(target, "params"):
        return False
    shapes = [np.shape(x) for x in jax.tree.leaves(acc.grads)]
    return bool(shapes) and shapes == [np.shape(x) for x in jax.tree.leaves(target.params)]


def check(mngr: Any, step: int, target: Any, count: int) -> None:
    """Raises when a sharded accumulator saved mid-window (``count > 0``) by one placement is
    restored into the other: owner rows and even pieces have the same shapes, so it would load
    without error and continue from wrongly arranged gradient sums."""
    if count <= 0 or not _sharded_accumulator(target):
        return
    wanted, saved_as = of(target), saved(mngr, step)
    if saved_as == wanted:
        return
    name = {"owner": 'jddp.ZeRO(stage=s, shard="owner")', "even": "jddp.ZeRO(stage=s)"}
    raise ValueError(
        f"Checkpoint of step {step} in {mngr.directory} was saved with {name[saved_as]} in the "
        f"middle of a gradient accumulation window ({count} calls accumulated), but this "
        f"trainer uses {name[wanted]}: the sharded accumulator's per-device pieces are arranged "
        f"differently ({saved_as} vs {wanted}; owner rows against even pieces, same shapes), so "
        "its partial sums would be read wrongly. Restore it with the placement that saved it "
        f"({name[saved_as]}), train to the window's synchronising call and save there, or "
        "restore a checkpoint saved at a window boundary (those restore into either placement)."
    )
