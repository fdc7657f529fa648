"""Optimizer state in host memory between steps (``jddp.ZeRO(stage=s, offload=True)``).

The one placement module of the offload feature (ZeRO-Offload; FSDP2's
``CPUOffloadPolicy(pin_memory=True)``): between steps every leaf of ``state.opt_state`` lives in
the devices' pinned host memory (its ``NamedSharding`` has ``memory_kind="pinned_host"``, split
over the data axis as at its stage); the step moves it to device memory for the update
(:func:`fetch`) and writes the new state back (:func:`store`), one transfer per leaf, placed in
the compiled schedule by XLA. On GPU and TPU these are asynchronous copies
(``copy-start``/``copy-done``) that the scheduler can overlap with the backward and the update;
XLA:CPU keeps every memory kind in the same RAM, so there the transfers compile to nothing and
the placement changes only the arrays' recorded memory kind.

The master parameters stay in device memory at every stage, stage 3 included: the forward and
the backward read every parameter each step (gathered bucket by bucket), so host-resident
parameters would put a host-to-device copy in front of every all-gather, on the critical path.
The optimizer state is read once per step, by the update, and with Adam it is twice the
parameters: the larger share, and the one whose transfer can hide behind the backward.
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
