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
import warnings
from collections.abc import Callable
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
    # The handler is registered up front so that item_metadata (the saved shapes, which restore
    # compares before loading anything) is readable before the first save or restore.
    return lib.CheckpointManager(
        os.path.abspath(os.fspath(directory)), options=options,
        item_handlers=lib.StandardCheckpointHandler(),
    )


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


def _path(path: Any) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


# Parts of a TrainState stored per device (a leading device dimension): they depend on the device
# count, so a checkpoint made on another count needs a decision for each (see restore()).
_PER_DEVICE = ("hook_state", "accum", "model_state")


def _per_device_changes(saved: Any, abstract: Any) -> list[tuple[str, tuple, tuple]]:
    """``(path, saved_shape, new_shape)`` of per-device leaves whose device count changed.

    Raises a clear error for any other difference (another model, another optimizer).
    """
    saved_shapes = {
        _path(p): tuple(getattr(x, "shape", ()))
        for p, x in jax.tree_util.tree_flatten_with_path(saved)[0]
    }
    wanted = {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    missing = sorted(set(wanted) - set(saved_shapes))
    extra = sorted(set(saved_shapes) - set(wanted))
    if missing or extra:
        raise ValueError(
            "The checkpoint does not hold the state this trainer builds (another model, "
            f"optimizer, hook or accumulation setting?): missing {missing[:5]}, unexpected "
            f"{extra[:5]}. Restore with the DataParallel configuration it was saved with."
        )
    changed = []
    for path, leaf in wanted.items():
        old, new = saved_shapes[path], tuple(leaf.shape)
        if old == new:
            continue
        spec: tuple = tuple(getattr(getattr(leaf, "sharding", None), "spec", ()))
        sharded_rows = bool(spec) and spec[0] is not None
        per_device = (path.split(".")[0] in _PER_DEVICE and len(old) == len(new)
                      and old[1:] == new[1:] and sharded_rows)
        if not per_device:
            raise ValueError(
                f"Checkpoint leaf {path} has shape {old}, but this trainer's state has {new}. "
                "Restore with the model and optimizer the checkpoint was saved with."
            )
        changed.append((path, old, new))
    return changed


def restore(
    mngr: Any,
    target: Any,
    *,
    step: int | None = None,
    init_fn: Callable[[], Any] | None = None,
) -> Any:
    """Restores a TrainState saved by :func:`save` onto the shardings of ``target``.

    The state may be restored on another number of devices: replicated leaves (and sharded ones)
    are resharded by orbax. Per-device leaves, which have one row per device, are decided one by
    one: the communication hook's state (PowerSGD's error feedback and warm start) restarts from
    its initial value, with a warning; an accumulator restores only at a window boundary (its
    counter 0) and restarts empty; a checkpoint saved mid-window, and per-device model state
    (``model_state_sync="none"``), raise an error naming the leaf, both device counts and the way
    out.

    Args:
      target: a TrainState like the one saved: concrete, or abstract with shardings (e.g.
        ``ddp.abstract_state(params_like)``), which places the restored arrays.
      step: which checkpoint (default: the latest).
      init_fn: ``init_fn() -> TrainState`` on the new device count (e.g. ``lambda:
        ddp.init(params)``), for per-device leaves that restart; called only when the device
        count changed. Not needed when ``target`` is a concrete state.
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
    metadata = mngr.item_metadata(step)
    if metadata is None:  # a manager not made by manager(): no shapes to compare; load strictly
        return mngr.restore(step, args=lib.args.StandardRestore(abstract))
    changed = _per_device_changes(metadata.tree, abstract)
    if not changed:
        return mngr.restore(step, args=lib.args.StandardRestore(abstract))
    old_n, new_n = changed[0][1][0], changed[0][2][0]
    where = f"saved on {old_n} devices, restored on {new_n}"
    per_replica = [p for p, _, _ in changed if p.startswith("model_state")]
    if per_replica:
        raise ValueError(
            f"Checkpoint of step {step} ({where}) holds one model state per device "
            f"(model_state_sync='none'; e.g. {per_replica[0]}): there is no correct way to turn "
            f"{old_n} replicas' states into {new_n}. Restore on {old_n} devices, or train with "
            "model_state_sync='broadcast' or 'mean' (one state for all replicas)."
        )
    # Every other changed leaf restarts: load the rest exactly; the changed leaves' loaded values
    # (padded or cut by strict=False) are replaced below.
    state = mngr.restore(step, args=lib.args.StandardRestore(abstract, strict=False))
    accum = [p for p, _, _ in changed if p.startswith("accum")]
    if accum and int(np.asarray(jax.device_get(state.accum.count))) > 0:
        raise ValueError(
            f"Checkpoint of step {step} ({where}) was saved in the middle of a gradient "
            f"accumulation window ({int(jax.device_get(state.accum.count))} calls accumulated, "
            f"e.g. {accum[0]}): each device's partial sum cannot be split over {new_n} devices. "
            f"Resume on {old_n} devices until the window's synchronising call and save there (a "
            "checkpoint at a window boundary restores on any device count)."
        )
    if init_fn is not None:
        fresh = init_fn()
    elif not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target)):
        fresh = target
    else:
        raise ValueError(
            f"Checkpoint of step {step} is {where}: its per-device state ({changed[0][0]}, ...) "
            "restarts, which needs the trainer's initial values. Pass init_fn=lambda: "
            "ddp.init(params), or use jddp.checkpoint.restore_or_init."
        )
    restart = {p for p, _, _ in changed}
    hooks = sorted(p for p in restart if p.startswith("hook_state"))
    if hooks:
        warnings.warn(
            f"Checkpoint of step {step} is {where}: the communication hook's per-device state "
            f"restarts from its initial value ({', '.join(hooks[:4])}"
            f"{', ...' if len(hooks) > 4 else ''}); PowerSGD's error feedback and warm start "
            "begin anew.", stacklevel=2,
        )
    return jax.tree_util.tree_map_with_path(
        lambda p, old, new: new if _path(p) in restart else old, state, fresh
    )


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
    return restore(mngr, ddp.abstract_state(params, model_state), step=step,
                   init_fn=lambda: ddp.init(params, model_state))


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
