"""The implementation of `jddp.checkpoint` (its module docstring is the guide): orbax managers
of two items (TrainState, loader state), collective saves, restores onto another device count."""

from __future__ import annotations

import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jddp._src.place import owner_state
from jddp._src.runtime import checkpoint_placement, hostsync, preemption, rendezvous
from jddp._src.runtime.coordinator import EXIT_RESUME
from jddp._src.step.nnx import DataParallel as NnxDataParallel
from jddp._src.step.state import LEGACY_FIELDS, from_legacy, to_legacy
from jddp._src.tree import key_path_str

__all__ = ["manager", "restore", "restore_or_init", "save", "save_if_due", "wait"]

# Names of the two items of a checkpoint made by manager(). "default" is orbax's name for the item
# of a single-item manager, so checkpoints saved before the loader item existed still restore.
STATE_ITEM, LOADER_ITEM = "default", "loader"

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


# Managers made by manager(): two items (TrainState, loader state), and a wait at exit.
_MANAGERS: weakref.WeakSet[Any] = weakref.WeakSet()


def _wait_all_at_exit() -> None:
    for mngr in list(_MANAGERS):
        try:
            mngr.wait_until_finished()
        except Exception as e:  # pragma: no cover - reported, not raised, at exit
            sys.stderr.write(f"jddp: an asynchronous checkpoint write failed at exit: {e}\n")


# At interpreter exit a pending asynchronous write must finish before the thread pools it needs
# refuse new work; threading's own exit hooks run before those pools shut down (plain atexit
# hooks run after, too late: orbax's commit then fails with "cannot schedule new futures").
getattr(threading, "_register_atexit", lambda f: None)(_wait_all_at_exit)


def manager(
    directory: str | os.PathLike[str],
    *,
    max_to_keep: int | None = None,
    save_interval_steps: int = 1,
    async_save: bool = False,
) -> Any:
    """An orbax ``CheckpointManager`` for TrainStates under ``directory`` (one folder per step).

    Each checkpoint holds two items: the TrainState and, when saved with one, a data loader's
    state (JSON).

    Args:
      max_to_keep: keep only the newest N checkpoints (default: keep all).
      save_interval_steps: the interval of :func:`save_if_due`: it saves at the steps that are
        multiples of it (and at a preemption), not at the first step (orbax's default
        "initial save" is turned off, so that the interval means what it says); :func:`save`
        always saves.
      async_save: write in a background thread (orbax's asynchronous checkpointing); the step
        only waits for the copy of the state to host memory. False (default): every save is on
        disk before it returns.
    """
    lib = _require_orbax()
    path = os.path.abspath(os.fspath(directory))
    for other in list(_MANAGERS):  # a new manager lists the folder: let this process's writes end
        if os.fspath(other.directory) == path:
            other.wait_until_finished()
    policies = lib.checkpoint_managers
    options = lib.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=save_interval_steps, create=True,
        enable_async_checkpointing=bool(async_save),
        # orbax's default policy, less its InitialSavePolicy (a save at the first step seen).
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(int(save_interval_steps)),
            policies.PreemptionCheckpointingPolicy(),
        ]),
    )
    # The handlers are registered up front so that item_metadata (the saved shapes, which restore
    # compares before loading anything) is readable before the first save or restore.
    mngr = lib.CheckpointManager(
        path, options=options,
        item_handlers={STATE_ITEM: lib.StandardCheckpointHandler(),
                       LOADER_ITEM: lib.JsonCheckpointHandler()},
    )
    _MANAGERS.add(mngr)
    return mngr


def wait(mngr: Any) -> None:
    """Waits until the manager's asynchronous writes are on disk (also raises their errors)."""
    mngr.wait_until_finished()


def _two_items(mngr: Any) -> bool:
    return mngr in _MANAGERS


def _save_args(mngr: Any, state: Any, loader: Any) -> Any:
    lib = _require_orbax()
    if not _two_items(mngr):  # a single-item manager made by the caller
        if loader is not None:
            raise ValueError(
                "Saving a loader state needs a manager made by jddp.checkpoint.manager() (two "
                "items per checkpoint: the TrainState and the loader)."
            )
        return lib.args.StandardSave(state)
    items = {STATE_ITEM: lib.args.StandardSave(state)}
    if loader is not None:
        items[LOADER_ITEM] = lib.args.JsonSave(loader.state())
    return lib.args.Composite(**items)


# How long a process that reached save waits for the others (see _expect_all).
BARRIER_TIMEOUT_S = 10.0


def _expect_all(call: str, step: int | None, timeout_s: float) -> None:
    """Checks, within ``timeout_s``, that every process reached this call (a save is
    collective: a process calling it alone would hang the others). Not in restore: start-up
    lengths differ between processes by more than a short timeout.
    """
    at = "" if step is None else f"(step={step})"
    rendezvous.expect_all(
        call, f"{call}{at}", timeout_s,
        f"{call} is collective: call it on every process with the same arguments (orbax "
        "writes each array once), not only under `if jddp.is_main_process():`. If a process is "
        f"merely late (e.g. it evaluates alone first), pass a larger barrier_timeout_s to {call}.")


def save(
    mngr: Any, state: Any, *, step: int | None = None, overwrite: bool = False,
    loader: Any = None, wait: bool = True, barrier_timeout_s: float = BARRIER_TIMEOUT_S,
) -> int:
    """Saves ``state`` (and ``loader``'s state) at ``step`` (default ``state.step``).

    Refuses to replace an existing checkpoint of the same step unless ``overwrite`` is set, so
    nothing saved is lost by a re-run. Collective: in a multi-process job every process calls
    it; a process that reaches it while another does not arrive within ``barrier_timeout_s``
    raises instead of waiting forever.

    Args:
      loader: a ``jddp.data.Loader`` whose state (the next batch) is saved with the TrainState.
      wait: wait until the checkpoint is on disk (default); False returns once the state is
        copied to host memory when the manager writes asynchronously (see :func:`wait`).
      barrier_timeout_s: how long to wait for the other processes to reach this save, once
        this process's ``state`` is computed (default 10 s).

    Returns:
      The step saved.

    Raises:
      RuntimeError: another process did not call ``save`` within ``barrier_timeout_s``.
    """
    # The state first: a step still running on this process is not the other processes' delay.
    jax.block_until_ready(state)
    step = int(np.asarray(jax.device_get(state.step))) if step is None else int(step)
    placement = checkpoint_placement.of(state)
    # Owner sharding keeps the optimizer state packed per owner: stored as optax's own tree.
    state = owner_state.portable(state)
    _expect_all("jddp.checkpoint.save", step, barrier_timeout_s)
    if step in mngr.all_steps():
        if not overwrite:
            raise FileExistsError(
                f"A checkpoint of step {step} already exists in {mngr.directory}. Pass "
                "overwrite=True to replace it, or save under another step."
            )
        mngr.wait_until_finished()
        mngr.delete(step)
    # force: the manager's save interval is for save_if_due; an explicit save always saves.
    mngr.save(step, args=_save_args(mngr, state, loader), force=True,
              custom_metadata={checkpoint_placement.KEY: placement})
    if wait:
        mngr.wait_until_finished()
    return step


class _Layout(NamedTuple):
    """Where a checkpoint layout keeps the per-device parts of a TrainState (they depend on the
    device count, so restoring on another count decides each, see restore()).

    Attributes:
      hook: the field of the communication hook's state (restarts, with a warning).
      window: the field of the accumulator (restores at a window boundary only).
    """

    per_device: tuple[str, ...]
    hook: str
    window: str


# TrainState's fields, one per policy role; the per-feature fields of earlier checkpoints.
_LAYOUT = _Layout(("reduce_state", "update_state", "model_state"), "reduce_state", "update_state")
_LEGACY = _Layout(("hook_state", "accum", "model_state"), "hook_state", "accum")


def _stored_shape(leaf: Any) -> tuple[int, ...]:
    """The shape orbax stores for ``leaf``: a typed PRNG key array (``key<fry>``, e.g. an NNX
    model's ``nnx.Rngs`` state) is written as its key data, with the key's trailing dimension."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return tuple(data.shape)
    return tuple(leaf.shape)


def _per_device_changes(saved: Any, abstract: Any,
                        layout: _Layout = _LAYOUT) -> list[tuple[str, tuple, tuple]]:
    """``(path, saved_shape, new_shape)`` of per-device leaves whose device count changed.

    Raises a clear error for any other difference (another model, another optimizer).
    """
    saved_shapes = {
        key_path_str(p): tuple(getattr(x, "shape", ()))
        for p, x in jax.tree_util.tree_flatten_with_path(saved)[0]
    }
    wanted = {key_path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
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
        old, new = saved_shapes[path], _stored_shape(leaf)
        if old == new:
            continue
        spec: tuple = tuple(getattr(getattr(leaf, "sharding", None), "spec", ()))
        sharded_rows = bool(spec) and spec[0] is not None
        per_device = (path.split(".")[0] in layout.per_device and len(old) == len(new)
                      and old[1:] == new[1:] and sharded_rows)
        if not per_device:
            replicas = _replica_axis(leaf, old, new)
            if replicas is not None:
                raise ValueError(
                    f"Checkpoint leaf {path} holds one copy per replica for {old[0]} replicas "
                    "(local SGD and DiLoCo keep each replica's parameters and optimizer state), "
                    f"but this trainer has {new[0]} replicas (its mesh's {replicas!r} axis): "
                    f"there is no correct way to turn {old[0]} replicas' states into {new[0]}. "
                    f"Restore on {old[0]} replicas (e.g. jddp.data_mesh(hosts={old[0]})); to "
                    "go on with another count, start a new run from the restored "
                    "ddp.global_params(state)."
                )
            raise ValueError(
                f"Checkpoint leaf {path} has shape {old}, but this trainer's state has {new}. "
                "Restore with the model and optimizer the checkpoint was saved with."
            )
        changed.append((path, old, new))
    return changed


def _replica_axis(leaf: Any, old: tuple, new: tuple) -> str | None:
    """The mesh axis ``leaf`` holds one row per replica over (a per-replica state: local SGD),
    when the saved shape differs only in that count; else ``None``."""
    sharding = getattr(leaf, "sharding", None)
    spec: tuple = tuple(getattr(sharding, "spec", ()))
    if (sharding is None or not spec or not isinstance(spec[0], str) or len(old) != len(new)
            or old[1:] != new[1:]):
        return None
    return spec[0] if sharding.mesh.shape[spec[0]] == new[0] else None


def _load_state(mngr: Any, step: int, args: Any) -> Any:
    if not _two_items(mngr):
        return mngr.restore(step, args=args)
    return mngr.restore(step, args=_require_orbax().args.Composite(**{STATE_ITEM: args}))[
        STATE_ITEM]


def _saved_tree(mngr: Any, step: int) -> Any:
    """The saved TrainState's metadata tree (shapes), or None when the manager has none."""
    metadata = mngr.item_metadata(step)
    if metadata is not None and _two_items(mngr):
        metadata = metadata[STATE_ITEM] if STATE_ITEM in metadata else None
    return None if metadata is None else metadata.tree


def _holds_loader(mngr: Any, step: int) -> bool:
    """Whether the checkpoint of ``step`` was saved with a loader's state."""
    return os.path.isdir(os.path.join(os.fspath(mngr.directory), str(step), LOADER_ITEM))


def _restore_loader(mngr: Any, step: int, loader: Any) -> None:
    lib = _require_orbax()
    if not _two_items(mngr):
        raise ValueError("Restoring a loader state needs a manager made by "
                         "jddp.checkpoint.manager().")
    if not _holds_loader(mngr, step):
        raise ValueError(
            f"The checkpoint of step {step} in {mngr.directory} holds no loader state (it was "
            "saved without loader=...): the data position cannot be restored. Restore without "
            "loader= and position the loader yourself, or start a new checkpoint directory."
        )
    saved = mngr.restore(step, args=lib.args.Composite(**{LOADER_ITEM: lib.args.JsonRestore()}))
    loader.restore(dict(saved[LOADER_ITEM]))


def restore(
    mngr: Any,
    target: Any,
    *,
    step: int | None = None,
    init_fn: Callable[[], Any] | None = None,
    loader: Any = None,
) -> Any:
    """Restores a TrainState saved by :func:`save` onto the shardings of ``target``.

    The state may be restored on another number of devices: replicated leaves (and sharded ones)
    are resharded by orbax. Per-device leaves, which have one row per device, are decided one by
    one: the communication hook's state (PowerSGD's error feedback and warm start) restarts from
    its initial value, with a warning; an accumulator restores only at a window boundary (its
    counter 0) and restarts empty; a checkpoint saved mid-window, and per-device model state
    (``jddp.Loss(model_state_sync="none")``), raise an error naming the leaf, both device counts and the way
    out.

    Owner sharding (``jddp.ZeRO(stage=s, shard="owner")``) arranges a sharded accumulator's pieces
    in owner rows, even sharding in even pieces, with the same shapes: a checkpoint saved
    mid-window with one restores into the same placement only; into the other it raises an error
    naming both (at a window boundary it restores into either).

    Args:
      target: a TrainState like the one saved: concrete, or abstract with shardings (e.g.
        ``ddp.abstract_state(params)``), which places the restored arrays.
      step: which checkpoint (default: the latest).
      init_fn: ``init_fn() -> TrainState`` on the new device count (e.g. ``lambda:
        ddp.init(params)``), for per-device leaves that restart; called only when the device
        count changed. Not needed when ``target`` is a concrete state.
      loader: a ``jddp.data.Loader`` to put at the batch after the checkpoint's (its state is
        checked against the loader's data set and batching: a clear error if it differs). The
        loader state holds no process or device count, so it restores on any layout.
    """
    lib = _require_orbax()
    mngr.wait_until_finished()  # a save still in flight may be the latest step
    if step is None:
        step = mngr.latest_step()
        if step is None:
            raise FileNotFoundError(f"No checkpoint found in {mngr.directory}.")
    elif step not in mngr.all_steps():
        raise FileNotFoundError(
            f"No checkpoint of step {step} in {mngr.directory}; saved steps: {mngr.all_steps()}."
        )
    packed = jax.tree.map(_as_abstract, target)
    # A checkpoint holds optax's own optimizer state; owner sharding's packed one is packed again.
    abstract = owner_state.portable_abstract(packed)
    if loader is not None:  # first: a wrong data set fails before any array is read
        _restore_loader(mngr, step, loader)
    saved_tree = _saved_tree(mngr, step)
    # A checkpoint of the per-feature layout (hook_state, accum, loss_scale, outer: saved before
    # the state was nested per policy role) restores into that layout's tree, then converts.
    legacy = isinstance(saved_tree, dict) and set(saved_tree) == set(LEGACY_FIELDS)
    layout = _LEGACY if legacy else _LAYOUT
    if legacy:
        abstract = to_legacy(abstract)
    # A manager not made by manager() has no shapes to compare: load strictly.
    changed = [] if saved_tree is None else _per_device_changes(saved_tree, abstract, layout)
    if not changed:
        state = _load_state(mngr, step, lib.args.StandardRestore(abstract))
    else:
        state = _restore_changed(mngr, step, abstract, target, changed, init_fn, layout)
    checkpoint_placement.check(mngr, step, packed, _window_count(state, layout))
    return owner_state.repack(from_legacy(state) if legacy else state, packed)


def _as_abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))


def _restore_changed(mngr: Any, step: int, abstract: Any, target: Any,
                     changed: list[tuple[str, tuple, tuple]],
                     init_fn: Callable[[], Any] | None, layout: _Layout) -> Any:
    """`restore` of a checkpoint whose per-device leaves ``changed`` their device count: each
    restarts from the trainer's initial values, or raises where that would be wrong."""
    old_n, new_n = changed[0][1][0], changed[0][2][0]
    where = f"saved on {old_n} devices, restored on {new_n}"
    per_replica = [p for p, _, _ in changed if p.startswith("model_state")]
    if per_replica:
        raise ValueError(
            f"Checkpoint of step {step} ({where}) holds one model state per device "
            f"(model_state_sync='none'; e.g. {per_replica[0]}): there is no correct way to turn "
            f"{old_n} replicas' states into {new_n}. Restore on {old_n} devices, or train with "
            "loss=jddp.Loss(model_state_sync='broadcast') or 'mean' (one state for all "
            "replicas)."
        )
    # Every other changed leaf restarts: load the rest exactly; the changed leaves' loaded values
    # (padded or cut by strict=False) are replaced below.
    state = _load_state(mngr, step, _require_orbax().args.StandardRestore(abstract, strict=False))
    accum = [p for p, _, _ in changed if p.startswith(layout.window)]
    count = _window_count(state, layout) if accum else 0
    if count > 0:
        raise ValueError(
            f"Checkpoint of step {step} ({where}) was saved in the middle of a gradient "
            f"accumulation window ({count} calls accumulated, "
            f"e.g. {accum[0]}): each device's partial sum cannot be split over {new_n} devices. "
            f"Resume on {old_n} devices until the window's synchronising call and save there (a "
            "checkpoint at a window boundary restores on any device count)."
        )
    if init_fn is not None:
        fresh = owner_state.portable(init_fn())
    elif not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target)):
        fresh = owner_state.portable(target)
    else:
        raise ValueError(
            f"Checkpoint of step {step} is {where}: its per-device state ({changed[0][0]}, ...) "
            "restarts, which needs the trainer's initial values. Pass init_fn=lambda: "
            "ddp.init(params), or use jddp.checkpoint.restore_or_init."
        )
    if layout is _LEGACY:
        fresh = to_legacy(fresh)
    restart = {p for p, _, _ in changed}
    hooks = sorted(p for p in restart if p.startswith(layout.hook))
    if hooks:
        warnings.warn(
            f"Checkpoint of step {step} is {where}: the communication hook's per-device state "
            f"restarts from its initial value ({', '.join(hooks[:4])}"
            f"{', ...' if len(hooks) > 4 else ''}); PowerSGD's error feedback and warm start "
            "begin anew.", stacklevel=3,
        )
    return jax.tree_util.tree_map_with_path(
        lambda p, old, new: new if key_path_str(p) in restart else old, state, fresh
    )


def _window_count(state: Any, layout: _Layout) -> int:
    """The accumulator's counter (calls accumulated in the window) of a loaded state."""
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if key_path_str(path) == f"{layout.window}.count":
            return int(np.asarray(jax.device_get(x)))
    return 0


def _host_step(state: Any) -> int:
    return int(np.asarray(jax.device_get(state.step)))


def _builders(ddp: Any, params: Any, model_state: Any) -> tuple[Callable[[], Any],
                                                                 Callable[[], Any]]:
    """``(init, abstract_state)`` of ``ddp`` for the arguments restore_or_init was given."""
    if isinstance(ddp, NnxDataParallel) and (params is None or isinstance(params, nnx.Module)):
        if model_state is not None:
            raise TypeError(
                "restore_or_init(mngr, ddp, model): a jddp.nnx.DataParallel takes its model state "
                "from the model (its non-Param variables); pass the model alone, or the split "
                "states: restore_or_init(mngr, ddp, *ddp.split(model)).")
        model = () if params is None else (params,)
        return lambda: ddp.init(*model), lambda: ddp.abstract_state(*model)
    if isinstance(ddp, NnxDataParallel):  # the states of ddp.split(model)
        ddp = ddp.core
    if params is None:
        raise TypeError("restore_or_init(mngr, ddp, params): jddp.DataParallel needs the initial "
                        "parameters (only their shapes and dtypes are used when restoring).")
    # Only the arguments given: a trainer's init may take the parameters alone.
    args = (params,) if model_state is None else (params, model_state)
    return lambda: ddp.init(*args), lambda: ddp.abstract_state(*args)


def restore_or_init(
    mngr: Any, ddp: Any, params: Any = None, model_state: Any = None, *, loader: Any = None
) -> Any:
    """The latest checkpoint in ``mngr`` restored for ``ddp``, or ``ddp.init(params, model_state)``.

    With it a training script resumes after a restart with no code of its own: the restored
    ``state.step`` says where to continue, and ``loader`` (if given) continues at the batch after
    the checkpoint's (without a checkpoint it is left where it is). Every process must see
    the same checkpoints (a shared directory on several hosts); a process that does not raises
    instead of starting a job whose processes disagree.

    Args:
      ddp: the ``jddp.DataParallel`` (or anything with its ``init`` and ``abstract_state``), or a
        ``jddp.nnx.DataParallel``.
      params: the initial parameters; when restoring, only their shapes and dtypes are used. For
        a ``jddp.nnx.DataParallel``: the model (default: the one it was built with; its
        non-``Param`` state is the model state), or the ``Param`` state of ``ddp.split(model)``.
      model_state: the initial model state (e.g. BatchNorm statistics), if any; with a
        ``jddp.nnx.DataParallel``, only with the split ``Param`` state.
      loader: a ``jddp.data.Loader`` saved with the checkpoints (``save_if_due(..., loader=)``).
    """
    init, abstract_state = _builders(ddp, params, model_state)
    step = mngr.latest_step()
    if jax.process_count() > 1:
        steps = hostsync.allgather(np.int64(-1 if step is None else step))
        if len(set(np.ravel(steps).tolist())) != 1:
            raise RuntimeError(
                f"processes see different latest checkpoints in {mngr.directory} (by process: "
                f"{np.ravel(steps).tolist()}, -1 = none): every process must read the same "
                "checkpoint directory (on several hosts, a shared file system)."
            )
    if step is None:
        return init()
    if loader is None and _holds_loader(mngr, step):
        raise ValueError(
            f"The checkpoint of step {step} in {mngr.directory} was saved with a data loader's "
            "position (save_if_due(..., loader=loader)), but restore_or_init was given no "
            "loader: the data would start again at its first batch and batches already trained "
            "on would be trained on again. Pass the loader, built as when saving: "
            "restore_or_init(mngr, ddp, params, loader=loader). To restore the TrainState alone "
            "on purpose (evaluation, another data set), use "
            "jddp.checkpoint.restore(mngr, ddp.abstract_state(params), init_fn=lambda: "
            "ddp.init(params))."
        )
    return restore(mngr, abstract_state(), step=step, init_fn=init, loader=loader)


def save_if_due(
    mngr: Any, state: Any, *, step: int | None = None, exit_on_preemption: bool = True,
    loader: Any = None, barrier_timeout_s: float = BARRIER_TIMEOUT_S,
) -> bool:
    """Saves ``state`` when due: on the manager's interval, or at the preemption sync point.

    Call it after every training step, on every process. The interval is orbax's
    ``CheckpointManager.should_save``: with a manager from :func:`manager`, the steps that are
    multiples of its ``save_interval_steps`` (interval 5: steps 5, 10, ...). Preemption is
    ``jddp.distributed.reached_preemption_point``: after a SIGTERM to any process, every process
    saves at the same step; then, with ``exit_on_preemption``, each exits with
    ``jddp.distributed.EXIT_RESUME`` (75, "resume me"), which ``jddp-run --max-restarts``
    restarts on, and :func:`restore_or_init` resumes from.

    Args:
      step: ``state.step`` as a host integer, if the loop knows it; otherwise it is read from
        the device, which waits for the step to finish (a sync per call).
      exit_on_preemption: False to return instead of exiting after a preemption save (then
        check ``jddp.preemption.reached_preemption_point(step)`` yourself).
      loader: a ``jddp.data.Loader`` whose state is saved with the TrainState: call this after
        the step that consumed the loader's last batch, so the saved state is the next batch.
      barrier_timeout_s: :func:`save`'s bound on the wait for the other processes.

    An interval save is asynchronous when the manager is (``async_save=True``): the step goes on while
    it is written, and the next save waits for it. A preemption save waits before exiting.

    Returns:
      True if a checkpoint was saved.
    """
    step = _host_step(state) if step is None else int(step)
    # Interval first: orbax's should_save also asks JAX's preemption sync point, which decides
    # once for a step, so asking again below gives the same answer on every process.
    due = bool(mngr.should_save(step))
    preempted = preemption.reached_preemption_point(step)
    saved = False
    if (due or preempted) and step not in mngr.all_steps():
        save(mngr, state, step=step, loader=loader, wait=preempted,
             barrier_timeout_s=barrier_timeout_s)
        saved = True
    if preempted and exit_on_preemption:
        mngr.wait_until_finished()
        if jax.process_index() == 0:
            sys.stderr.write(f"jddp: preempted: checkpoint of step {step} saved in "
                             f"{mngr.directory}; exiting with status {EXIT_RESUME} "
                             "(resume)\n")
        preemption.exit_for_resume()
    return saved
