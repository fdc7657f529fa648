"""Optimizer state in host memory between steps (``jddp.ZeRO(stage=s, offload=True)``).

Between steps ``state.opt_state`` lives in pinned host memory; the step fetches it for the update
and stores the new state back, one transfer per leaf (docs/sharded.md, "Offloading").
"""

from __future__ import annotations

from typing import Any

import jax

HOST = "pinned_host"


def _host(sharding: Any) -> Any:
    return sharding.with_memory_kind(HOST)


def place(shardings: Any) -> Any:
    """A state's shardings (a ``TrainState`` of ``NamedSharding``) with its optimizer state in
    host memory."""
    return shardings.replace(opt_state=jax.tree.map(_host, shardings.opt_state))


def fetch(state: Any) -> Any:
    """Inside the step: ``state`` with its optimizer state moved to device memory (one transfer
    per leaf; XLA's host-offload passes place them in the schedule)."""
    return state.replace(opt_state=jax.tree.map(
        lambda x: jax.device_put(x, jax.memory.Space.Device), state.opt_state))


def store(state: Any) -> Any:
    """Inside the step: the new ``state`` with its optimizer state written back to host memory."""
    return state.replace(opt_state=jax.tree.map(
        lambda x: jax.device_put(x, jax.memory.Space.Host), state.opt_state))


def device_copy(tree: Any) -> Any:
    """Outside the step: ``tree`` with its host-memory leaves copied to device memory (for the
    programs that read a state besides the step, e.g. ``ddp.verify``)."""
    return jax.tree.map(
        lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")) if on_host(x) else x,
        tree)


def on_host(x: Any) -> bool:
    """Whether an array (or shape struct) is placed in host memory."""
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    return kind is not None and kind != "device"
