"""Where the training state lives: :class:`Place`, the placement protocol with the replicated
defaults, and :class:`Replicate` (DDP), which is those defaults.

Every decision that depends on where parameters, gradients and optimizer state live is a method
of the step's placement; each takes the pieces of the step it needs, never the configuration
(docs/design.md, "Where to add a feature").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp._src.api import options
from jddp._src.core import precision as precision_lib
from jddp._src.core import zero
from jddp._src.core.bytemodel import Bytes
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.plan.planner import BucketPlan
from jddp._src.runtime.topology import Roles, Topology

Shape = Sequence[int]


# ------------------------------------------------------------------------------------ helpers


def keep_unused(plan: BucketPlan, old: Any, new: Any) -> Any:
    """``new`` with the plan's unused leaves (no gradient path to the loss) kept at ``old``.

    PyTorch's DDP leaves a parameter that no rank used without a gradient (``.grad`` stays
    ``None``) and its optimizers skip such a parameter, so AdamW's weight decay and a momentum
    left from earlier steps do not move it; optax sees a zero gradient and would. The default
    follows DDP (``find_unused_parameters`` users expect it); ``Buckets(keep_unused=True)`` puts the
    leaves in the buckets and the optimizer updates them like any other (optax's semantics).
    """
    if not plan.unused:
        return new
    kept, treedef = jax.tree.flatten(new)
    was = jax.tree.leaves(old)
    for i in plan.unused:
        kept[i] = was[i]
    return jax.tree.unflatten(treedef, kept)


# ------------------------------------------------------------------------------ the policies

# ZeRO's options, named when given to Replicate.
_ZERO_OPTIONS = frozenset({"stage", "reshard_after_forward", "hybrid", "offload", "shard"})


@dataclasses.dataclass(frozen=True)
class Place:
    """A placement: every method the step calls, with the do-nothing default (the replicated
    path: whole parameters, gradients and optimizer state on every device, in device memory).

    A placement overrides what it changes (:class:`ZeRO1`, :class:`ZeRO2`, :class:`ZeRO3`);
    :class:`Replicate` overrides nothing. The user's value is resolved against the mesh once
    (:meth:`resolve`, by :class:`jddp._src.step.config.StepConfig`), and the step calls the
    resolved placement's methods.
    """

    @property
    def sharded(self) -> bool:
        """Whether some state is sharded (also the jit's ``sharded`` compiler option)."""
        return False

    @property
    def check_vma(self) -> bool:
        """Whether the per-device step's ``shard_map`` can be typed (``check_vma``)."""
        return True

    @property
    def splits_grads(self) -> bool:
        """Whether each device keeps only its piece of every split reduced gradient."""
        return False

    @property
    def splits_params(self) -> bool:
        """Whether each device holds only its piece of every split parameter leaf."""
        return False

    def topology(self, mesh: Mesh, *, islands: bool = False) -> Topology:
        """The roles of ``mesh`` for a step placed so (``islands``: local SGD's replicas)."""
        return Topology.of(mesh, islands=islands)

    def resolve(self, topology: Topology) -> Place:
        """The placement the step runs, checked against the mesh (here: itself)."""
        return self

    def param_spec(self, topo: Topology, shape: Shape) -> P:
        """The partition spec of a parameter leaf of ``shape`` (replicated)."""
        return P()

    def opt_spec(self, topo: Topology, shape: Shape) -> P:
        """The partition spec of an optimizer-state leaf of ``shape`` (replicated)."""
        return P()

    def init_opt_state(self, optimizer: optax.GradientTransformation, topo: Topology,
                       params: Any) -> Any:
        """The optimizer's initial state as kept between steps (optax's own)."""
        return optimizer.init(params)

    def stored(self, shardings: Any) -> Any:
        """A state's ``NamedSharding`` s as it is kept between steps (all in device memory)."""
        return shardings

    def device_view(self, state: Any) -> Any:
        """The state the per-device phases take (all of it)."""
        return state

    def fetch(self, state: Any) -> Any:
        """Inside the step, the state as the update reads it (as it is)."""
        return state

    def store(self, state: Any) -> Any:
        """Inside the step, the new state as it is kept between steps (as it is)."""
        return state

    def grad_specs(self, topo: Topology, layout: zero.Layout, params: Any, rep: P) -> Any:
        """Out specs of the reduced gradients (``rep``: whole, per replica with local SGD)."""
        return rep

    def grad_zeros(self, params: Any, layout: zero.Layout) -> Any:
        """The reduced gradients of a call that does not synchronise (zeros, whole)."""
        return jax.tree.map(jnp.zeros_like, params)

    def reduction(self, layout: zero.Layout, lv: Roles) -> zero.Sharded | None:
        """The sharded reduction's record (``None``: the hook's all-reduce)."""
        return None

    def trace_params(self, varying: Any, whole: Any) -> Any:
        """The parameters the loss is traced at: this device's (varying) ones."""
        return varying

    def local_params(self, topo: Topology, lv: Roles, plan: BucketPlan, layout: zero.Layout,
                     chain: options.Chain, params: Any, varying: Any,
                     precision: precision_lib.MixedPrecision | None) -> tuple[Any, Bytes]:
        """The parameters local gradients (earlier micro-batches, no-sync calls) are taken at
        (``varying``: as typed for local gradients) and the bytes of getting them (none)."""
        return varying, Bytes()

    def mark_not_resharded(self, plan: BucketPlan, traced: jaxpr_lib.Traced,
                           layout: zero.Layout) -> BucketPlan:
        """``plan`` with the leaves resharding cannot free (nothing is resharded here)."""
        return plan

    def update(self, optimizer: optax.GradientTransformation, topo: Topology,
               layout: zero.Layout, plan: BucketPlan, chain: options.Chain, params: Any,
               opt_state: Any, grads: Any, record: Any = None) -> tuple[Any, Any]:
        """``(new_params, new_opt_state)`` of one replica: the optimizer on the reduced
        gradients, unused leaves kept (:func:`keep_unused`). ``record``: told the bytes the
        update itself sends when traced (none here: never called)."""
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return keep_unused(plan, params, optax.apply_updates(params, updates)), opt_state

    def update_sent(self, topo: Topology, plan: BucketPlan, layout: zero.Layout) -> Bytes:
        """What the update sends to make the parameters whole again, known before it is traced
        (inside the per-device step, whose ``comm_bytes`` count it): none."""
        return Bytes()

    def leaf_owners(self, layout: zero.Layout) -> tuple[int, ...] | None:
        """Each split leaf's owner device, the rows its reduce-scatter lands in (``None``: even
        pieces)."""
        del layout
        return None

    def owners(self, topo: Topology, params: Any,
               plan: BucketPlan | None = None) -> Any:
        """Each leaf's owner device and what moves (an ``OwnerPlan``; ``None``: no owners at
        this placement)."""
        return None


@dataclasses.dataclass(frozen=True, init=False)
class Replicate(Place):
    """Every device holds the whole parameters, gradients and optimizer state (DDP): every
    method is :class:`Place`'s default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No options: a ZeRO option given here is named, with where it belongs.
        if not args and not kwargs:
            return
        given = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        zero_names = [k for k in kwargs if k in _ZERO_OPTIONS]
        hint = (f" {', '.join(zero_names)} is an option of sharded placement: "
                f"place=jddp.ZeRO(stage=..., {zero_names[0]}=...) (e.g. jddp.ZeRO(stage=1, "
                "offload=True) keeps the optimizer state in host memory, split over devices)."
                if zero_names else "")
        raise TypeError(f"jddp.Replicate() takes no options (every device holds everything), "
                        f"got {given}.{hint}")
