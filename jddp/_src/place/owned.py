"""The owner placement's classes (``jddp.ZeRO(stage=s, shard="owner")`` resolved): each stage
of :mod:`jddp._src.place.stages` with the optimizer state packed per owner and each leaf's
update run whole on its owner (:mod:`jddp._src.place.owner`), the gradients reduce-scattered in
owner rows from stage 2. Everything else (the parameters' and gradients' storage, the forward
gathers, offload, hybrid sharding) is the even stage's, inherited.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from jddp._src.api import options
from jddp._src.core import zero
from jddp._src.core.bytemodel import Bytes
from jddp._src.place import owner, owner_plan
from jddp._src.place.stages import ZeRO1, ZeRO2, ZeRO3
from jddp._src.plan.planner import BucketPlan
from jddp._src.runtime.topology import Topology


class Owned:
    """What ``shard="owner"`` changes at every stage (mixed in before the stage's class)."""

    splits_params: bool
    splits_grads: bool

    def init_opt_state(self, optimizer: optax.GradientTransformation, topo: Topology,
                       params: Any) -> Any:
        """The optimizer state packed per owner (:func:`jddp._src.place.owner.init_state`; its
        rows are split like any leaf, one per device)."""
        return owner.init_state(optimizer, params, topo.shard_count)

    def update(self, optimizer: optax.GradientTransformation, topo: Topology,
               layout: zero.Layout, plan: BucketPlan, chain: options.Chain, params: Any,
               opt_state: Any, grads: Any, record: Any = None) -> tuple[Any, Any]:
        """Each leaf updated on its owner (:func:`jddp._src.place.owner.update`), which tells
        ``record`` (when not ``None``) the bytes it sends once traced: they depend on what the
        optimizer reads, which :meth:`update_sent` does not see."""
        del chain
        return owner.update((self.splits_params, self.splits_grads), optimizer, topo, layout,
                            plan, params, opt_state, grads, record)

    def update_sent(self, topo: Topology, plan: BucketPlan, layout: zero.Layout) -> Bytes:
        """None before tracing: :meth:`update` records its bytes when traced."""
        return Bytes()

    def leaf_owners(self, layout: zero.Layout) -> tuple[int, ...] | None:
        """Each leaf's owner (:func:`jddp._src.place.owner.assign`): the reduce-scatter's rows."""
        return owner.assign(layout.shapes, layout.n).owner

    def owners(self, topo: Topology, params: Any,
               plan: BucketPlan | None = None) -> owner_plan.OwnerPlan | None:
        """Each leaf's owner device and what moves for the step's bucket plan ``plan``
        (:func:`jddp._src.place.owner_plan.plan`)."""
        return owner_plan.plan(params, topo.shard_count, plan,
                               (self.splits_params, self.splits_grads))


@dataclasses.dataclass(frozen=True)
class OwnedZeRO1(Owned, ZeRO1):
    """``ZeRO(stage=1, shard="owner")`` resolved."""


@dataclasses.dataclass(frozen=True)
class OwnedZeRO2(Owned, ZeRO2):
    """``ZeRO(stage=2, shard="owner")`` resolved: gradients reduce-scattered in owner rows."""


@dataclasses.dataclass(frozen=True)
class OwnedZeRO3(Owned, ZeRO3):
    """``ZeRO(stage=3, shard="owner")`` resolved: parameters in pieces as at stage 3."""


STAGES: dict[int, type[ZeRO1]] = {1: OwnedZeRO1, 2: OwnedZeRO2, 3: OwnedZeRO3}
