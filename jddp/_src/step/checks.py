"""Checks of what a user passes in (params, losses, batches, masks), each written once, with
messages that name the problem and the fix. Trace-time only: nothing here costs a step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp._src.tree import dtype_of, key_path_str


def check_float_params(params: Any) -> None:
    """Raises unless ``params`` has at least one leaf and every leaf is floating point."""
    path_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not path_leaves:
        raise ValueError(
            "params has no array leaves: there is nothing to train (PyTorch's DDP refuses a "
            "module without parameters too). Pass the model's parameters, e.g. "
            "model.init(rng, x)['params']."
        )
    for path, leaf in path_leaves:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"Parameter {key_path_str(path)} has dtype {dtype}; every parameter leaf must be "
                "floating point to be differentiated. Move integer or boolean leaves (step "
                "counters, masks, RNG keys) out of params, e.g. into the batch or model state."
            )


def check_scalar_loss(loss: Any) -> None:
    """Raises TypeError unless ``loss`` (an array or shape struct) is a floating-point scalar."""
    if (
        not hasattr(loss, "shape")
        or jnp.shape(loss) != ()
        or not jnp.issubdtype(jnp.result_type(loss), jnp.floating)
    ):
        raise TypeError(
            "loss_fn must return a scalar floating-point loss (the mean over its shard of the "
            f"batch), got {jnp.result_type(loss) if hasattr(loss, 'dtype') else type(loss).__name__}"
            f"{list(jnp.shape(loss)) if hasattr(loss, 'shape') else ''}. Reduce it with .mean(), or "
            "return (loss, metrics) with loss=jddp.Loss(has_aux=True)."
        )


def batch_size(batch: Any) -> int:
    """The common leading dimension of every leaf of ``batch`` (clear errors if there is none)."""
    path_leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not path_leaves:
        raise ValueError("The batch is empty: it must be a pytree with at least one array leaf.")
    sizes: dict[int, str] = {}
    for path, leaf in path_leaves:
        shape = np.shape(leaf)
        if len(shape) == 0:
            raise ValueError(
                f"Batch leaf {key_path_str(path)} is a scalar; every batch leaf needs a leading "
                "batch dimension. Pass constants through the loss function instead."
            )
        sizes.setdefault(shape[0], key_path_str(path))
    if len(sizes) > 1:
        desc = ", ".join(f"{p}: {n}" for n, p in sizes.items())
        hint = ""
        if any(_looks_like_keys(path, leaf) for path, leaf in path_leaves):
            hint = (" A PRNG key in the batch is split with it like any leaf, so it needs one "
                    "key per example; for pmap-style keys (one per device, or one per step) "
                    "build the DataParallel with loss=jddp.Loss(rng=True) and pass the run's "
                    "key, step(state, batch, rng=key): each example gets its own key from it "
                    "(docs/flax.md).")
        raise ValueError(
            f"Batch leaves have different leading dimensions ({desc}); every leaf must have the "
            f"same batch size as its first dimension.{hint}"
        )
    (size,) = sizes
    return size


def _looks_like_keys(path: Any, leaf: Any) -> bool:
    """A typed PRNG key array, or a leaf named like one (raw keys are plain uint32)."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    name = key_path_str(path).lower()
    return any(word in name for word in ("rng", "key", "dropout"))


def check_batch(batch: Any, num_devices: int) -> int:
    """Checks that the batch is non-empty with one leading dimension divisible by ``num_devices``.

    Returns:
      The global batch size.
    """
    size = batch_size(batch)
    if size == 0:
        raise ValueError(
            "The global batch has 0 examples: a step on no data would still advance the optimizer "
            "(Adam moves the params) with a NaN loss. Skip empty batches in the input pipeline."
        )
    if size % num_devices:
        lo = size - size % num_devices
        raise ValueError(
            f"The global batch size {size} is not divisible by the {num_devices} devices of the "
            f"data mesh. Use a multiple of {num_devices} (e.g. {lo or num_devices} or "
            f"{lo + num_devices}), drop the remainder, or pad and mask the last batch "
            "(jddp.data.pad_batch)."
        )
    return size


def check_mask(mask: Any, global_size: int) -> jax.Array:
    """A mask or weights for a batch of ``global_size`` examples, as float32.

    The mask is per example (shape ``(global_size,)``) or per token (any shape with that leading
    dimension, shaped like the loss of the whole batch).
    """
    shape = tuple(np.shape(mask))
    if not shape or shape[0] != global_size:
        raise ValueError(
            f"The mask has shape {shape} but the batch has {global_size} examples; it must have "
            f"the batch as its leading dimension: ({global_size},) for one entry per example "
            "(True/1 real, False/0 padding; jddp.data.pad_batch returns one), or the shape of the "
            "unreduced loss for per-token weights."
        )
    dtype = dtype_of(mask)
    if not (dtype == np.bool_ or np.issubdtype(dtype, np.integer)
            or np.issubdtype(dtype, np.floating)):
        raise TypeError(f"The mask must be boolean or real (per-example weights), got {dtype}.")
    return jnp.asarray(mask).astype(jnp.float32)


def check_train_state(state: Any, cls: type) -> None:
    """Raises TypeError unless ``state`` is a ``cls`` (the TrainState), naming where one comes from."""
    if isinstance(state, cls):
        return
    hint = ""
    if isinstance(state, dict):
        keys = sorted(map(str, state))[:6]
        hint = (f" This dict (keys {keys}) may be the params themselves, Flax variables, or a "
                "checkpoint restored without a target (restore with "
                "jddp.checkpoint.restore(mngr, ddp.abstract_state(params))).")
    raise TypeError(
        f"step expects the jddp TrainState that ddp.init(params) returns (or a previous step "
        f"returned), got {type(state).__name__}. Build it with state = ddp.init(params).{hint}"
    )


def params_paths(params: Any) -> tuple[str, ...]:
    """The dotted paths of ``params``' leaves, in flattening order."""
    return tuple(key_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def check_same_params_tree(expected: tuple[str, ...], params: Any) -> None:
    """Raises ValueError naming the differing paths if ``params`` is not a tree of ``expected``
    paths (a state of another model)."""
    got = params_paths(params)
    if got == expected:
        return
    missing = [p for p in expected if p not in set(got)]
    extra = [p for p in got if p not in set(expected)]

    def shown(paths: list[str]) -> str:
        return ", ".join(paths[:8]) + (f", ... ({len(paths)} in all)" if len(paths) > 8 else "")

    raise ValueError(
        "state.params is not a params tree of this DataParallel's model (the one ddp.init was "
        f"given): the state of another model or trainer?\n  missing from the state: "
        f"{shown(missing) or '-'}\n  not in the model: {shown(extra) or '-'}\nUse the state "
        "this trainer's init (or its last step) returned, or call ddp.init(params) with the "
        "model's params."
    )


def _off_mesh(tree: Any, devices: set) -> list[tuple[str, list[int]]]:
    """The leaves of ``tree`` that are JAX arrays committed to devices other than ``devices``."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and getattr(leaf, "committed", True):
            placed = set(leaf.sharding.device_set)
            if placed != devices:
                out.append((key_path_str(path), sorted(int(getattr(d, "id", -1)) for d in placed)))
    return out


def placement_error(state: Any, batch: Any, mask: Any, mesh: Any) -> ValueError | None:
    """A clear error for step inputs committed to devices that are not the mesh's (JAX's own
    says "incompatible devices for jitted computation"), or ``None`` if none is."""
    devices = set(mesh.devices.flat)
    ids = sorted(int(d.id) for d in devices)
    bad = _off_mesh({"batch": batch, "mask": mask}, devices)
    if bad:
        path, where = bad[0]
        return ValueError(
            f"The step's input {path} is on devices {where}, but this DataParallel's mesh has "
            f"devices {ids}{f' (and {len(bad) - 1} more leaves)' if len(bad) > 1 else ''}. Pass the "
            "batch as host data (NumPy arrays: the step splits it over the mesh), place it "
            "with jddp.shard_batch(batch, ddp.mesh) (any number of processes), or read it from "
            "a jddp.data.Loader built with mesh=ddp.mesh."
        )
    bad = _off_mesh(state, devices)
    if bad:
        path, where = bad[0]
        return ValueError(
            f"The TrainState leaf {path} is on devices {where}, but this DataParallel's mesh has "
            f"devices {ids}: the state was made by a trainer on another mesh (or moved). Make it "
            "with this trainer (ddp.init(params), or restore it with ddp.abstract_state(params) "
            "as the target)."
        )
    return None


def check_concrete_state(state: Any) -> None:
    """Refuses a TrainState of shape structs (``ddp.abstract_state``) given to the step."""
    if isinstance(getattr(state, "step", None), jax.ShapeDtypeStruct):
        raise TypeError(
            "The step was given an abstract TrainState (jax.ShapeDtypeStruct leaves, as "
            "ddp.abstract_state(params) returns): it describes a state, it holds no values. "
            "Restore a checkpoint into it (jddp.checkpoint.restore(mngr, "
            "ddp.abstract_state(params)), or jddp.checkpoint.restore_or_init(mngr, ddp, params)), "
            "or start fresh with ddp.init(params). (ddp.step.lower(...) takes abstract states.)"
        )
