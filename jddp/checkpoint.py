"""Checkpoints of the whole TrainState with orbax, from one process or many.

Every array of the state (params, optimizer, model, hook and accumulation state, step) is saved
with its sharding: replicated leaves once, per-device leaves (hook and accumulator state) shard by
shard, so a restore continues exactly where the run stopped. In a multi-process run every process
calls ``save``/``restore`` with the same arguments; orbax coordinates the writes.

    mngr = jddp.checkpoint.manager("ckpt", max_to_keep=3)
    jddp.checkpoint.save(mngr, state)                       # at state.step
    state = jddp.checkpoint.restore(mngr, ddp.abstract_state(params))   # latest step
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

try:
    import orbax.checkpoint as ocp
except ImportError:  # pragma: no cover - exercised only without the extra
    ocp = None


__all__ = ["manager", "restore", "save"]


def _require_orbax() -> Any:
    if ocp is None:
        raise ModuleNotFoundError(
            "jddp.checkpoint needs orbax: pip install 'jddp[checkpoint]' (orbax-checkpoint)."
        )
    return ocp


def manager(directory: str | os.PathLike[str], *, max_to_keep: int | None = None) -> Any:
    """An orbax ``CheckpointManager`` for TrainStates under ``directory`` (one folder per step).

    Args:
      max_to_keep: keep only the newest N checkpoints (default: keep all).
    """
    lib = _require_orbax()
    options = lib.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return lib.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options)


def save(mngr: Any, state: Any, *, step: int | None = None, overwrite: bool = False) -> int:
    """Saves ``state`` at ``step`` (default ``state.step``) and waits until it is on disk.

    Refuses to replace an existing checkpoint of the same step unless ``overwrite`` is set, so
    nothing saved is lost by a re-run.

    Returns:
      The step saved.
    """
    lib = _require_orbax()
    step = int(np.asarray(jax.device_get(state.step))) if step is None else int(step)
    if step in mngr.all_steps():
        if not overwrite:
            raise FileExistsError(
                f"A checkpoint of step {step} already exists in {mngr.directory}. Pass "
                "overwrite=True to replace it, or save under another step."
            )
        mngr.delete(step)
    mngr.save(step, args=lib.args.StandardSave(state))
    mngr.wait_until_finished()
    return step


def restore(mngr: Any, target: Any, *, step: int | None = None) -> Any:
    """Restores a TrainState saved by :func:`save` onto the shardings of ``target``.

    Args:
      target: a TrainState like the one saved: concrete, or abstract with shardings (e.g.
        ``ddp.abstract_state(params_like)``), which places the restored arrays.
      step: which checkpoint (default: the latest).
    """
    lib = _require_orbax()
    if step is None:
        step = mngr.latest_step()
        if step is None:
            raise FileNotFoundError(f"No checkpoint found in {mngr.directory}.")
    elif step not in mngr.all_steps():
        raise FileNotFoundError(
            f"No checkpoint of step {step} in {mngr.directory}; saved steps: {mngr.all_steps()}."
        )

    def as_abstract(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))

    abstract = jax.tree.map(as_abstract, target)
    return mngr.restore(step, args=lib.args.StandardRestore(abstract))
