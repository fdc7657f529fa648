"""Checks of what a user passes in (params, losses, batches, masks), each written once, with
messages that name the problem and the fix. Trace-time only: nothing here costs a step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp._src.introspect import jaxpr as jaxpr_lib
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
            "(jddp.pad_batch)."
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
            "(True/1 real, False/0 padding; jddp.pad_batch returns one), or the shape of the "
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


# Collectives whose result is the same on every device of the axes they name: a value computed from
# the examples only through them no longer depends on which device's shard it came from.
_REPLICATING = frozenset({"psum", "psum2", "psum_invariant", "pmax", "pmin", "all_gather",
                          "all_gather_invariant"})
_NONE, _THROUGH, _DIRECT = 0, 1, 2  # how a variable reaches the loss (see _reach)


def _replicating(eqn: Any) -> bool:
    axes = eqn.params.get("axes", eqn.params.get("axis_name"))
    named = [a for a in (axes if isinstance(axes, tuple | list) else (axes,)) if isinstance(a, str)]
    return eqn.primitive.name in _REPLICATING and bool(named)


def _spelled(eqn: Any) -> str:
    """A replicating collective as the user wrote it: ``lax.psum/lax.pmean over 'data'``."""
    name = eqn.primitive.name
    user = ("lax.psum/lax.pmean" if name.startswith("psum")
            else "lax.all_gather" if name.startswith("all_gather") else f"lax.{name}")
    axes = eqn.params.get("axes", eqn.params.get("axis_name"))
    axes = axes if isinstance(axes, tuple | list) else (axes,)
    return f"{user} over {', '.join(repr(a) for a in axes if isinstance(a, str))}"


def _reach(jaxpr: Any, out_marks: list[int], found: list[str]) -> list[int]:
    """Per input of ``jaxpr``: how it reaches the outputs marked in ``out_marks`` (``_DIRECT``:
    along some path with no replicating collective; ``_THROUGH``: only through one; ``_NONE``).
    Plain calls and branches are walked into; any other equation with a sub-jaxpr (a loop, a
    custom rule) counts as direct, so the walk may miss a reduced loss, never flag a local one.
    ``found`` collects the replicating collectives met on a direct path."""
    mark: dict[Any, int] = {}
    for v, m in zip(jaxpr.outvars, out_marks, strict=True):
        if not jaxpr_lib.is_literal(v):
            mark[v] = max(mark.get(v, _NONE), m)

    def give(v: Any, m: int) -> None:
        if m and not jaxpr_lib.is_literal(v):
            mark[v] = max(mark.get(v, _NONE), m)

    for eqn in reversed(jaxpr.eqns):
        outs = [mark.get(v, _NONE) for v in eqn.outvars]
        top = max(outs, default=_NONE)
        if not top:
            continue
        if _replicating(eqn):
            if top == _DIRECT:
                found.append(_spelled(eqn))
            for v in eqn.invars:
                give(v, _THROUGH)
            continue
        subs = jaxpr_lib.sub_jaxprs(eqn)
        inner_ok = subs and all(sub is not None and len(sub.outvars) == len(outs)
                                for sub, _ in subs)
        if not inner_ok or eqn.primitive.name in ("while", "scan"):
            for v in eqn.invars:
                give(v, top)
            continue
        for sub, outer in subs:
            for v, m in zip(outer, _reach(sub, outs, found), strict=True):
                give(v, m)
    return [mark.get(v, _NONE) for v in jaxpr.invars]


def check_loss_not_reduced(jaxpr: Any, per_device: Sequence[bool]) -> None:
    """Refuses a loss that is reduced over the data mesh (``lax.pmean(loss, "data")``, the
    ``pmap`` habit): jddp averages the gradients itself, so such a loss trains at 1/N the step.

    The rule: the differentiated output (``jaxpr``'s first) reaches the device's own examples
    (the inputs marked ``per_device``) only through collectives that make a value the same on
    every device (``psum``/``pmean``/``pmax``/``pmin``/``all_gather``). Collectives on values the
    loss also combines with its own examples pass: cross-replica BatchNorm's statistics
    (``x - pmean(mean(x))``), a contrastive loss against gathered embeddings; so does a global
    normaliser (``sum(local) / psum(count)``, which the docs steer to ``Loss(weighted=True)``).
    """
    found: list[str] = []
    marks = _reach(jaxpr, [_DIRECT] + [_NONE] * (len(jaxpr.outvars) - 1), found)
    marks = [m for m, d in zip(marks, per_device, strict=True) if d]
    if not marks or max(marks) != _THROUGH:
        return
    what = ", ".join(dict.fromkeys(found)) or "a cross-device reduction"
    raise ValueError(
        f"loss_fn reduces its loss over the data mesh ({what} on the loss): every device "
        "then differentiates the same global value, and since jddp itself averages the "
        "gradients over devices, the update would be 1/N of the right one. Return this "
        "device's own loss (the mean over its shard of the batch): drop the lax.pmean/lax.psum "
        "of the loss; metrics['loss'] is already the mean over every device. For a mean over "
        "the global batch's real examples or tokens (psum(loss_sum) / psum(count)), return the "
        "unreduced losses with loss=jddp.Loss(weighted=True) and pass the weights as the mask. "
        "Collectives on intermediate values (cross-replica BatchNorm statistics) are fine."
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
            "batch as host data (NumPy arrays: the step splits it over the mesh), or place it "
            "on the mesh: jddp.shard_batch(batch, ddp.mesh) (one process), "
            "jddp.shard_global_batch(batch, ddp.mesh), or a jddp.data.Loader built with "
            "mesh=ddp.mesh."
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
