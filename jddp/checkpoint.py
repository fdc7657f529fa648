"""Checkpoints of the whole TrainState with orbax, from one process or many.

Every array of the state (params, optimizer, model, hook and accumulation state, step) is saved
with its sharding: replicated leaves once, per-device leaves (hook and accumulator state) shard by
shard, so a restore continues exactly where the run stopped. In a multi-process run every process
calls ``save``/``restore`` with the same arguments; orbax coordinates the writes.

    mngr = jddp.checkpoint.manager("ckpt", max_to_keep=3)
    jddp.checkpoint.save(mngr, state)                       # at state.step
    state = jddp.checkpoint.restore(mngr, ddp.abstract_state(params))   # latest step

A training loop that survives failures and preemption (run it with ``jddp-run --max-restarts N``
or under any scheduler that re-runs it on exit status 75)::

    mngr = jddp.checkpoint.manager("ckpt", max_to_keep=3, save_interval_steps=100)
    state = jddp.checkpoint.restore_or_init(mngr, ddp, params)   # latest checkpoint, or fresh
    for step in range(int(state.step), num_steps):
        state, metrics = ddp.step(state, batch_for(step))        # batches follow from the step
        jddp.checkpoint.save_if_due(mngr, state, step=step + 1)  # every 100 steps; on SIGTERM:
                                                                 # save, then exit with 75
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jddp import distributed

__all__ = ["manager", "restore", "restore_or_init", "save", "save_if_due"]

try:
    import orbax.checkpoint as ocp
except ImportError:  # pragma: no cover - exercised only without the extra
    ocp = None


def _require_orbax() -> Any:
    if ocp is None:
        raise ModuleNotFoundError(
            "jddp.checkpoint needs orbax: pip install 'jddp[checkpoint]' (orbax-checkpoint)."
        )
    return ocp


def manager(
    directory: str | os.PathLike[str],
    *,
    max_to_keep: int | None = None,
    save_interval_steps: int = 1,
) -> Any:
    """An orbax ``CheckpointManager`` for TrainStates under ``directory`` (one folder per step).

    Args:
      max_to_keep: keep only the newest N checkpoints (default: keep all).
      save_interval_steps: the interval of :func:`save_if_due` (orbax's ``should_save``);
        :func:`save` always saves.
    """
    lib = _require_orbax()
    options = lib.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps, create=True
    )
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
    # force: the manager's save interval is for save_if_due; an explicit save always saves.
    mngr.save(step, args=lib.args.StandardSave(state), force=True)
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


def _host_step(state: Any) -> int:
    return int(np.asarray(jax.device_get(state.step)))


def restore_or_init(mngr: Any, ddp: Any, params: Any, model_state: Any = None) -> Any:
    """The latest checkpoint in ``mngr`` restored for ``ddp``, or ``ddp.init(params, model_state)``.

    With it a training script resumes after a restart with no code of its own: the restored
    ``state.step`` says where to continue (derive the data order from it). Every process must see
    the same checkpoints (a shared directory on several hosts); a process that does not raises
    instead of starting a job whose processes disagree.

    Args:
      ddp: the ``jddp.DataParallel`` (or anything with its ``init`` and ``abstract_state``).
      params: the initial parameters; when restoring, only their shapes and dtypes are used.
      model_state: the initial model state (e.g. BatchNorm statistics), if any.
    """
    step = mngr.latest_step()
    if jax.process_count() > 1:
        steps = multihost_utils.process_allgather(np.int64(-1 if step is None else step))
        if len(set(np.ravel(steps).tolist())) != 1:
            raise RuntimeError(
                f"processes see different latest checkpoints in {mngr.directory} (by process: "
                f"{np.ravel(steps).tolist()}, -1 = none): every process must read the same "
                "checkpoint directory (on several hosts, a shared file system)."
            )
    if step is None:
        return ddp.init(params, model_state)
    return restore(mngr, ddp.abstract_state(params, model_state), step=step)


def save_if_due(
    mngr: Any, state: Any, *, step: int | None = None, exit_on_preemption: bool = True
) -> bool:
    """Saves ``state`` when due: on the manager's interval, or at the preemption sync point.

    Call it after every training step, on every process. The interval is orbax's
    ``CheckpointManager.should_save`` (``save_interval_steps`` of :func:`manager`). Preemption is
    ``jddp.distributed.reached_preemption_point``: after a SIGTERM to any process, every process
    saves at the same step; then, with ``exit_on_preemption``, each exits with
    ``jddp.distributed.EXIT_RESUME`` (75, "resume me"), which ``jddp-run --max-restarts``
    restarts on, and :func:`restore_or_init` resumes from.

    Args:
      step: ``state.step`` as a host integer, if the loop knows it; otherwise it is read from
        the device, which waits for the step to finish (a sync per call).
      exit_on_preemption: False to return instead of exiting after a preemption save (then
        check ``jddp.distributed.reached_preemption_point(step)`` yourself).

    Returns:
      True if a checkpoint was saved.
    """
    step = _host_step(state) if step is None else int(step)
    # Interval first: orbax's should_save also asks JAX's preemption sync point, which decides
    # once for a step, so asking again below gives the same answer on every process.
    due = bool(mngr.should_save(step))
    preempted = distributed.reached_preemption_point(step)
    saved = False
    if (due or preempted) and step not in mngr.all_steps():
        save(mngr, state, step=step)
        saved = True
    if preempted and exit_on_preemption:
        if jax.process_index() == 0:
            sys.stderr.write(f"jddp: preempted: checkpoint of step {step} saved in "
                             f"{mngr.directory}; exiting with status {distributed.EXIT_RESUME} "
                             "(resume)\n")
        distributed.exit_for_resume()
    return saved
