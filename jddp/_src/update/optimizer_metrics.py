"""Optimizer-side metrics: the hyperparameters of ``optax.inject_hyperparams``, in ``metrics``
(read from the optimizer state after the update, e.g. ``metrics["learning_rate"]``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jddp._src.tree import key_path_str

_INJECTED = tuple(
    t for t in (getattr(optax, "InjectHyperparamsState", None),
                getattr(optax, "InjectStatefulHyperparamsState", None))
    if t is not None
)


def _is_injected(x: Any) -> bool:
    return isinstance(x, _INJECTED)


def optimizer_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """The scalar hyperparameters of every ``inject_hyperparams`` state in ``opt_state``.

    Each is reported under its own name (``"learning_rate"``); a name found in several injected
    states (an ``optax.chain`` of two) is prefixed by the state's path (``"1.learning_rate"``).
    """
    found: list[tuple[str, str, Any]] = []
    for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_injected)[0]:
        if not _is_injected(node):
            continue
        for name, value in node.hyperparams.items():
            if jnp.shape(value) == () and jnp.issubdtype(jnp.result_type(value), jnp.number):
                found.append((key_path_str(path), str(name), value))
    counts = Counter(name for _, name, _ in found)
    return {
        (name if counts[name] == 1 else f"{where}.{name}"): jnp.asarray(value, jnp.float32)
        for where, name, value in found
    }


def merge_optimizer_metrics(metrics: dict, extra: dict) -> dict:
    """``metrics`` with the optimizer's ``extra`` metrics added; a clear error on a name clash."""
    clash = sorted(set(extra) & set(metrics))
    if clash:
        raise ValueError(
            f"The metrics {clash} come both from loss_fn (or the step) and from the optimizer's "
            "optax.inject_hyperparams state; rename the aux metric."
        )
    return {**metrics, **extra}
