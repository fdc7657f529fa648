"""Communication hooks: how one bucket of gradients is reduced across the data axis.

DDP's ``register_comm_hook`` as a pair of pure functions, like an optax transformation:
``init(leaf_struct) -> state`` and ``reduce(grads, states, ctx) -> (means, new_states)``
(docs/hooks.md). This package holds the protocol (:class:`CommHook`, :class:`HookContext`), the
checks every hook's output passes, and one module per built-in family (:mod:`.mean`,
:mod:`.cast`, :mod:`.int8`, :mod:`.powersgd`, :mod:`.hierarchical`), public as :mod:`jddp.hooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jddp._src.introspect import vma
from jddp._src.tree import key_path_str

#: The built-in hook factories (:mod:`jddp.hooks`), named in the error for a factory passed
#: uncalled.
FACTORIES = ("allreduce_mean", "fp16_compress", "bf16_compress", "powersgd", "hierarchical")


class HookContext(NamedTuple):
    """What a hook knows about where it runs.

    Attributes:
      axis_name: the mesh axis to reduce over.
      axis_size: number of replicas along it.
      step: the optimizer step being computed (a traced int32 scalar).
      bucket_index: which bucket of the plan this is.
      phase: the hook's static phase for this step (``hook.phase(step)``), when the caller knows
        the step on the host (:class:`jddp.DataParallel` does); ``None`` otherwise.
      hosts_axis: on a two-level (hosts, local) mesh, the name in ``axis_name`` that crosses
        hosts (the slow link); ``None`` on a 1-D mesh, or when the reduction stays inside a host.
      local_axis: the part of ``axis_name`` inside a host (``axis_name`` itself when
        ``hosts_axis`` is ``None``; ``None`` when the caller did not say).
    """

    axis_name: Any
    axis_size: int
    step: jax.Array
    bucket_index: int
    phase: Hashable | None = None
    hosts_axis: str | None = None
    local_axis: Any = None


class CommHook(NamedTuple):
    """A communication hook: ``init(leaf) -> state`` and ``reduce(grads, states, ctx)``.

    Attributes:
      init: ``init(jax.ShapeDtypeStruct) -> state`` for one parameter leaf (floating-point pytree).
      reduce: ``reduce(grads, states, ctx) -> (mean_grads, new_states)`` for one bucket.
      name: shown in errors and benchmarks.
      fuses_extras: ``reduce`` averages any extra float32 scalars appended to ``grads`` (with state
        ``()``) exactly, so the step's metrics can ride on the last bucket's collective.
      bytes_sent: ``bytes_sent(leaves, axis_size, step) -> bytes`` one device sends for a bucket
        with gradient structs ``leaves`` (declared; it overrides what is counted). ``None``: the
        built-in hooks' bytes are counted as they issue their collectives; a hook that calls
        ``jax.lax`` collectives itself counts as a ring all-reduce at the leaves' dtype.
      phase: ``phase(step: int) -> hashable``, for hooks whose collectives change with the step
        (PowerSGD's start). :class:`jddp.DataParallel` compiles one step per phase and passes it
        as ``HookContext.phase``, so no collective sits inside a ``lax.cond``.
      scatter: ``scatter(rows, ctx) -> row``, the hook's reduce-scatter for the sharded stages
        (``jddp.ZeRO(stage=2)`` and 3): ``rows`` is a bucket as an ``(N, K)`` matrix, one row per
        device; the result is the mean over devices of this device's row, shape ``(1, K)``.
        Used only by stateless hooks (it takes no state); its bytes are
        ``scatter_bytes_by_level``'s, half ``bytes_sent`` of the rows, or counted like
        ``reduce``'s (a ring reduce-scatter of the rows for ``jax.lax`` collectives). ``None``,
        or a hook with state: the sharded stages reduce the bucket with ``reduce`` and keep
        this device's piece.
      bytes_by_level: ``bytes_by_level(leaves, hosts, local, step) -> (inside, across)``: bytes
        one device sends inside its host and to other hosts for a bucket on a two-level mesh of
        ``hosts`` x ``local`` devices (declared); ``None``: ``bytes_sent`` split like a flat
        ring over all devices, hosts in order (:func:`jddp.hooks.ring_bytes_by_level`), or
        counted as for ``bytes_sent``.
      scatter_bytes_by_level: ``scatter_bytes_by_level(rows, hosts, local, step) -> (inside,
        across)``: bytes one device sends in ``scatter`` of the ``(N, K)`` matrix ``rows`` over
        ``hosts`` x ``local`` devices (``hosts`` is 1 on one level; declared); ``None``: see
        ``scatter``.
    """

    init: Callable[[jax.ShapeDtypeStruct], Any]
    reduce: Callable[
        [tuple[jax.Array, ...], tuple, HookContext], tuple[tuple[jax.Array, ...], tuple]
    ]
    name: str = "hook"
    fuses_extras: bool = False
    bytes_sent: Callable[[Sequence[jax.ShapeDtypeStruct], int, Any], Any] | None = None
    phase: Callable[[int], Hashable] | None = None
    scatter: Callable[[jax.Array, HookContext], jax.Array] | None = None
    bytes_by_level: Callable[[Sequence[jax.ShapeDtypeStruct], int, int, Any], Any] | None = None
    scatter_bytes_by_level: Callable[[jax.ShapeDtypeStruct, int, int, Any], Any] | None = None


def no_state(leaf: jax.ShapeDtypeStruct) -> tuple:
    """The state of a stateless hook: none."""
    del leaf
    return ()


def check_hook(hook: Any) -> CommHook:
    """``hook`` if it is a :class:`CommHook` (or quacks like one); a TypeError naming the fix if not.

    PyTorch registers a hook *function*; here a hook is the value a factory returns, so the most
    common mistake is passing the factory itself (``Buckets(hook=jddp.bf16_compress)``).
    """
    if isinstance(hook, CommHook):
        return hook
    name = getattr(hook, "__name__", None)
    if callable(hook) and not hasattr(hook, "reduce"):
        call = f"jddp.{name}()" if name in FACTORIES else f"{name or 'the factory'}(...)"
        raise TypeError(
            f"hook={name or repr(hook)} is a function, not a communication hook: call it, e.g. "
            f"hook={call}. A hook is a jddp.hooks.CommHook(init, reduce), where "
            "init(leaf_struct) -> state and reduce(grads, states, ctx) -> (mean_grads, "
            "new_states)."
        )
    if not (callable(getattr(hook, "init", None)) and callable(getattr(hook, "reduce", None))):
        raise TypeError(
            f"hook must be a jddp.hooks.CommHook(init, reduce) (e.g. jddp.fp16_compress()), got "
            f"{type(hook).__name__} {hook!r}. init(leaf_struct) -> state; reduce(grads, states, "
            "ctx) -> (mean_grads, new_states)."
        )
    return hook


def init_hook_state(hook: CommHook, params: Any) -> tuple:
    """The initial hook state: one entry per leaf of ``params``, in ``jax.tree.leaves`` order."""
    hook = check_hook(hook)
    states = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        state = hook.init(jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf)))
        for x in jax.tree.leaves(state):
            if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
                raise TypeError(
                    f"Communication hook {hook_name(hook)!r} made a {jnp.result_type(x)} state "
                    f"leaf for {key_path_str(path)}; hook state must be floating point (it leaves "
                    "the backward pass as a cotangent). Keep counters as float32, or use "
                    "HookContext.step."
                )
        states.append(state)
    return tuple(states)


def leaf_str(x: Any) -> str:
    """An array's or struct's dtype and shape as messages show them: ``float32[3, 4]``."""
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}"


def hook_name(hook: Any) -> str:
    """The name a hook is shown under in messages."""
    return str(getattr(hook, "name", "hook"))


# ------------------------------------------------------------------- what a hook returned


_HOOK_SIGNATURE = (
    "reduce(grads: tuple[Array, ...], states: tuple, ctx: HookContext) -> "
    "(mean_grads: tuple[Array, ...], new_states: tuple)"
)


def check_output(hook: CommHook, grads: Sequence[jax.Array], out: Any, index: int) -> tuple:
    """``(reduced, new_states)`` from what ``hook.reduce`` returned, or a clear error."""
    name = hook_name(hook)
    if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], tuple | list)):
        got = type(out).__name__
        if isinstance(out, tuple | list):
            got += f" of {len(out)} {', '.join(type(x).__name__ for x in out[:3])}..."
        raise TypeError(
            f"Communication hook {name!r} must return a pair (mean_grads, new_states) for bucket "
            f"{index}, got {got}. The expected signature is {_HOOK_SIGNATURE}; a stateless hook "
            "returns its states argument unchanged."
        )
    reduced, new_states = out
    if len(reduced) != len(grads):
        raise ValueError(
            f"Communication hook {name!r} returned {len(reduced)} gradients for bucket {index} of "
            f"{len(grads)} leaves; it must return one reduced gradient per leaf, in order."
        )
    for j, (g, r) in enumerate(zip(grads, reduced, strict=True)):
        if jnp.shape(r) != jnp.shape(g) or jnp.result_type(r) != jnp.result_type(g):
            raise ValueError(
                f"Communication hook {name!r} changed leaf {j} of bucket {index} from "
                f"{leaf_str(g)} to {leaf_str(r)}. A hook must return gradients with the shapes and dtypes it "
                "was given (cast back after compressing)."
            )
    return tuple(reduced), tuple(new_states)


def check_reduced(hook: CommHook, reduced: Sequence[jax.Array], axis_name: Any, index: int):
    """A hook's output must be the same on every replica (reduced), not each device's own."""
    for j, r in enumerate(reduced):
        if any(a in vma.varying_axes(r) for a in vma.axis_names(axis_name)):
            raise ValueError(
                f"Communication hook {hook_name(hook)!r} returned leaf {j} of bucket {index} "
                f"unreduced: it still varies over the data axis {axis_name!r}, so replicas would "
                "apply different updates and drift apart. A hook must reduce (psum/pmean, "
                "all_gather) every gradient. To skip communication on most steps, use local SGD "
                "or DiLoCo (sync=jddp.local_sgd.diloco(...)) instead of a hook, or "
                "accumulate=jddp.Accumulate(steps=k) for gradient accumulation."
            )


def check_state(hook: CommHook, old: Any, new: Any, index: int) -> None:
    """A hook's new state must keep the old one's structure, shapes and dtypes."""
    name = hook_name(hook)
    # jaxlib types PyTreeDef loosely for mypy (no __ne__ it can see); the comparison is real.
    if jax.tree.structure(old) != jax.tree.structure(new):  # type: ignore[operator]
        raise ValueError(
            f"Communication hook {name!r} changed the structure of its state for bucket {index}: "
            f"{jax.tree.structure(old)} -> {jax.tree.structure(new)}."
        )
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(
                f"Communication hook {name!r} changed a state leaf of bucket {index} from "
                f"{leaf_str(a)} to {leaf_str(b)}; hook state must keep its shapes and dtypes."
            )
