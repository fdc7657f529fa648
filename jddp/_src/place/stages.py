"""ZeRO's placements: the user's :class:`ZeRO` and the placement of each stage it resolves to.

:meth:`ZeRO.resolve` gives one :class:`jddp._src.place.placement.Place` per stage, each overriding
only what its stage changes: :class:`ZeRO1` splits the optimizer state, :class:`ZeRO2` also the
reduced gradients, :class:`ZeRO3` also the parameters. ``shard="owner"`` resolves to their
subclasses in :mod:`jddp._src.place.owned`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.api import options
from jddp._src.core import precision as precision_lib
from jddp._src.core import recorder, zero
from jddp._src.core.bytemodel import Bytes
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.introspect import vma
from jddp._src.place import offload
from jddp._src.place.placement import Place, Shape, keep_unused
from jddp._src.plan.planner import BucketPlan
from jddp._src.runtime.topology import Roles, Topology
from jddp._src.tree import chain_dependency

# ----------------------------------------------------------------------- the gathers of the stages


def bucket_groups(plan: BucketPlan) -> list[tuple[int, ...]]:
    """The buckets' leaves, then the unused leaves (which are in no bucket)."""
    return [b.indices for b in plan.buckets] + [tuple(plan.unused)]


def gather_chain(chain: options.Chain) -> Any:
    """How consecutive all-gathers are kept apart: an always-zero add on the previous pieces (as
    for the sharded stages' reduce-scatters, whatever the reduction's ``chain`` resolves to),
    ``None`` with ``Buckets(chain="none")``."""
    if chain == "none":
        return None

    def add(prev: list, pieces: list) -> list:
        dep = chain_dependency(prev, "add")
        return [p + dep.astype(p.dtype) for p in pieces]
    return add


def gather_params(topo: Topology, chain: options.Chain, params: Any, layout: zero.Layout,
                  plan: BucketPlan, after: Any = None) -> Any:
    """Split parameters made whole on every device: one all-gather per bucket, in plan order,
    each chained on the previous one (so XLA's all-gather combiners keep them apart).

    Args:
      chain: the reduction's chain mode (:func:`gather_chain`).
      after: arrays (in this device's pieces, like the gradients) that the first all-gather waits
        for: the last bucket's reduced gradient, so that no all-gather competes with the
        backward pass's reduce-scatters (on GPU they then overlapped no backward GEMM).
    """
    leaves, treedef = jax.tree.flatten(params)
    specs = jax.tree.leaves(layout.specs(params, topo.shard), is_leaf=lambda x: isinstance(x, P))
    after_leaves = jax.tree.leaves(after)
    after_specs = [zero.leaf_spec(s, topo.shard_count, topo.shard) for s in
                   (jnp.shape(x) for x in after_leaves)]
    local = functools.partial(_gather_pieces, topo, chain, layout, plan)
    gathered = jax.shard_map(
        local, mesh=topo.mesh, in_specs=(specs, after_specs), out_specs=P(), check_vma=False,
    )(leaves, after_leaves)
    return jax.tree.unflatten(treedef, gathered)


def _gather_pieces(topo: Topology, chain: options.Chain, layout: zero.Layout, plan: BucketPlan,
                   xs: list, wait: list) -> list:
    """:func:`gather_params` on one device: its pieces ``xs`` made whole, the first all-gather
    after ``wait``."""
    link = gather_chain(chain)
    if wait and link is not None:
        first = next((g for g in bucket_groups(plan)
                      if any(layout.dims[i] is not None for i in g)), ())
        idx = [i for i in first if layout.dims[i] is not None]
        waited = link(wait, [xs[i] for i in idx])
        xs = list(xs)
        for i, x in zip(idx, waited, strict=True):
            xs[i] = x
    return zero.gather_buckets(xs, layout, bucket_groups(plan), topo.shard, link)


def _constrain(mesh: Mesh, tree: Any, specs: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), tree, specs,
        is_leaf=lambda x: x is None,
    )


# ------------------------------------------------------------------------------ the placements


@dataclasses.dataclass(frozen=True)
class ZeRO(Place):
    """Sharded data parallelism (ZeRO; FSDP's ``FULL_SHARD`` at stage 3).

    The user's value: the step runs the placement it resolves to (:meth:`resolve`:
    :class:`ZeRO1`, :class:`ZeRO2` or :class:`ZeRO3`, one class per stage).

    Attributes:
      stage: 1 shards the optimizer state over the data axis, 2 also reduce-scatters each
        bucket's gradients, 3 also keeps only a piece of each parameter, gathered before use.
        (Stage 0 is :class:`Replicate`.)
      reshard_after_forward: stage 3 only. ``True`` (the default there): gathered parameters
        are dropped after the forward and gathered again for the backward; ``False`` keeps
        them; an int ``k`` keeps a copy split over groups of ``k`` devices (ZeRO++'s hpZ).
      hybrid: on a two-level mesh (``data_mesh(hosts=...)``), shard inside each host and
        replicate across hosts (FSDP's ``HYBRID_SHARD``).
      offload: keep the optimizer state in (pinned) host memory between steps, split as at
        this stage; each step moves it to the devices for the update and back
        (ZeRO-Offload, FSDP2's ``CPUOffloadPolicy``). The
        parameters stay in device memory, stage 3 included.
      shard: ``"even"`` (the default) splits every leaf over the devices and the optimizer
        updates the pieces in the global view; ``"owner"`` gives each leaf one owner device
        that runs its whole update (docs/sharded.md: for whole-matrix optimizers such as
        ``optax.contrib.muon``, whose orthogonalization then runs once and without collectives).
        The parameters and gradients are stored as with ``"even"``, the optimizer state
        packed per owner (each device only its leaves'; checkpoints hold optax's own state).
    """

    stage: int = 3
    reshard_after_forward: bool | int | None = None
    hybrid: bool = False
    offload: bool = False
    shard: str = "even"

    def __post_init__(self) -> None:
        stage = self.stage
        if isinstance(stage, bool) or not isinstance(stage, int | np.integer) \
                or int(stage) not in _STAGES:
            hint = " Stage 0 (nothing sharded) is place=jddp.Replicate()." if stage == 0 else ""
            raise ValueError(f"ZeRO.stage must be 1, 2 or 3, got {stage!r}: 1 shards the "
                             f"optimizer state, 2 also the gradients, 3 also the parameters."
                             f"{hint}")
        # A frozen dataclass normalises its own fields in __post_init__; object.__setattr__
        # is the documented way to do that.
        object.__setattr__(self, "stage", int(stage))
        self.resharding()  # checks it (kept as given, so dataclasses.replace works)
        object.__setattr__(self, "hybrid", options.flag(self.hybrid, "ZeRO.hybrid"))
        object.__setattr__(self, "offload", options.flag(self.offload, "ZeRO.offload"))
        if self.shard not in ("even", "owner"):
            raise ValueError(f"ZeRO.shard must be 'even' (every leaf split over the devices) or "
                             f"'owner' (each leaf whole on one owner device), got {self.shard!r}.")

    def _staged(self) -> ZeRO1:
        """This stage's placement, not yet checked against a mesh: ``shard="owner"`` resolves
        to the owner placement's class of the stage (:mod:`jddp._src.place.owned`)."""
        if self.shard == "owner":
            from jddp._src.place import owned  # subclasses of this module's stages

            return owned.STAGES[self.stage](self)
        return _STAGES[self.stage](self)

    def resharding(self) -> bool | int:
        """``reshard_after_forward`` resolved: ``None`` is ``True`` at stage 3, else ``False``;
        a bool or a group size ``k`` only at stage 3."""
        return options.reshard_after_forward(self.reshard_after_forward, self.stage,
                                             self.splits_params)

    @property
    def reshard_group(self) -> int | None:
        """The group size of ZeRO++'s hpZ (an int ``reshard_after_forward``), else ``None``."""
        k = self.resharding()
        return None if isinstance(k, bool) else k

    @property
    def sharded(self) -> bool:
        return True

    @property
    def check_vma(self) -> bool:
        return self._staged().check_vma

    @property
    def splits_grads(self) -> bool:
        return self._staged().splits_grads

    @property
    def splits_params(self) -> bool:
        return self._staged().splits_params

    def topology(self, mesh: Mesh, *, islands: bool = False) -> Topology:
        # hybrid's needs (a two-level mesh) are a row of jddp._src.step.compat.
        return Topology.of(mesh, hybrid=self.hybrid, sharded=True, islands=islands)

    def resolve(self, topology: Topology) -> Place:
        """This stage's placement (:class:`ZeRO1`, :class:`ZeRO2`, :class:`ZeRO3`), checked
        against the mesh."""
        return self._staged().resolve(topology)


@dataclasses.dataclass(frozen=True)
class ZeRO1(Place):
    """``ZeRO(stage=1)`` resolved: the optimizer state split over the shard axis, each device
    updating its pieces, which are then all-gathered; and what every stage shares (the
    topology, offload).

    Attributes:
      policy: the user's :class:`ZeRO` (resolved against the mesh at stage 3).
    """

    policy: ZeRO

    @property
    def sharded(self) -> bool:
        return True

    def topology(self, mesh: Mesh, *, islands: bool = False) -> Topology:
        return self.policy.topology(mesh, islands=islands)

    def opt_spec(self, topo: Topology, shape: Shape) -> P:
        """The partition spec of an optimizer-state leaf of ``shape`` (split)."""
        return zero.leaf_spec(shape, topo.shard_count, topo.shard)

    def stored(self, shardings: Any) -> Any:
        """A state's ``NamedSharding`` s as it is kept between steps: with ``offload``, the
        optimizer state's in host memory."""
        return offload.place(shardings) if self.policy.offload else shardings

    def device_view(self, state: Any) -> Any:
        """The state the per-device phases take: they never read the optimizer state, so
        offloaded it stays on the host."""
        return state.replace(opt_state=None) if self.policy.offload else state

    def fetch(self, state: Any) -> Any:
        """Inside the step, the state as the update reads it: with ``offload`` the optimizer
        state comes from host memory."""
        return offload.fetch(state) if self.policy.offload else state

    def store(self, state: Any) -> Any:
        """Inside the step, the new state as it is kept between steps: with ``offload`` the
        optimizer state goes back to host memory."""
        return offload.store(state) if self.policy.offload else state

    def update(self, optimizer: optax.GradientTransformation, topo: Topology,
               layout: zero.Layout, plan: BucketPlan, chain: options.Chain, params: Any,
               opt_state: Any, grads: Any, record: Any = None) -> tuple[Any, Any]:
        """``(new_params, new_opt_state)`` of one replica: each device updates its pieces.

        The update runs in the global view on leaves of their true shapes, so any optax
        transformation works unchanged (XLA adds the collectives a global norm or a factored
        moment needs); then the parameters are made whole again (:meth:`_whole`).
        """
        del record  # what it sends is known before it is traced (update_sent)
        axis = topo.shard
        specs = layout.specs(params, axis)
        opt_specs = jax.tree.map(lambda x: zero.leaf_spec(jnp.shape(x), topo.shard_count, axis),
                                 opt_state)
        # Slicing a replicated array to this device's piece moves no data.
        params = _constrain(topo.mesh, params, specs)
        grads = _constrain(topo.mesh, grads, specs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        new = _constrain(topo.mesh, keep_unused(plan, params, optax.apply_updates(params, updates)),
                         specs)
        opt_state = _constrain(topo.mesh, opt_state, opt_specs)
        return self._whole(topo, chain, new, layout, plan, grads), opt_state

    def _whole(self, topo: Topology, chain: options.Chain, new: Any, layout: zero.Layout,
               plan: BucketPlan, grads: Any) -> Any:
        """The updated parameters as the state keeps them: stages 1-2 all-gather the pieces,
        one all-gather per bucket (:func:`gather_params`), the first after the last bucket's
        gradient."""
        last = [jax.tree.leaves(grads)[i] for i in (plan.buckets[-1].indices
                                                    if plan.buckets else ())]
        return gather_params(topo, chain, new, layout, plan, after=last)

    def update_sent(self, topo: Topology, plan: BucketPlan, layout: zero.Layout) -> Bytes:
        """What the update sends to make the parameters whole again (:meth:`_whole`), before
        it is traced: its all-gathers recorded (:mod:`jddp._src.core.recorder`) as they are
        traced on this device's pieces, not run (inside the per-device step, whose
        ``comm_bytes`` count them and whose axes they name)."""
        pieces = [jax.ShapeDtypeStruct(zero.shard_shape(s, d, layout.n), t)
                  for s, d, t in zip(layout.shapes, layout.dims, plan.dtypes, strict=True)]

        def gather(xs: list) -> list:
            return _gather_pieces(topo, "none", layout, plan,
                                  [vma.to_varying(x, topo.shard) for x in xs], [])

        with recorder.recording(topo.axes.hosts) as rec:
            jax.eval_shape(gather, pieces)
        return rec.sent


@dataclasses.dataclass(frozen=True)
class ZeRO2(ZeRO1):
    """``ZeRO(stage=2)`` resolved: stage 1, and each bucket's gradients reduce-scattered, so
    each device keeps its pieces of the reduced gradients."""

    @property
    def check_vma(self) -> bool:
        """Not typed: the reduce-scatter returns values vma types cannot express as replicated
        (whole leaves and metrics riding on it); that ``shard_map`` is untyped, like pmap,
        which the bucket hooks support (they do the only reduction either way)."""
        return False

    @property
    def splits_grads(self) -> bool:
        return True

    def grad_specs(self, topo: Topology, layout: zero.Layout, params: Any, rep: P) -> Any:
        """Out specs of the reduced gradients: in pieces (after ``rep``, the replica axis with
        local SGD)."""
        return jax.tree.map(lambda s: P(*rep, *s), layout.specs(params, topo.shard),
                            is_leaf=lambda x: isinstance(x, P))

    def grad_zeros(self, params: Any, layout: zero.Layout) -> Any:
        """The reduced gradients of a call that does not synchronise: zeros, in this device's
        pieces."""
        return jax.tree.unflatten(jax.tree.structure(params), [
            jnp.zeros(zero.shard_shape(s, d, layout.n), jnp.result_type(x)) for s, d, x in
            zip(layout.shapes, layout.dims, jax.tree.leaves(params), strict=True)
        ])

    def reduction(self, layout: zero.Layout, lv: Roles) -> zero.Sharded | None:
        """Each bucket reduce-scattered (hybrid: then averaged across hosts), in the rows
        :meth:`leaf_owners` gives."""
        return zero.Sharded(layout, lv.shard_axis, lv.hybrid, owners=self.leaf_owners(layout))


@dataclasses.dataclass(frozen=True)
class ZeRO3(ZeRO2):
    """``ZeRO(stage=3)`` resolved (FSDP's ``FULL_SHARD``): stage 2, and each device holds
    only its pieces of the parameters, all-gathered bucket by bucket before their first use
    (:class:`jddp._src.reduce.sharded.GatherInForward`)."""

    @property
    def splits_params(self) -> bool:
        return True

    def resolve(self, topology: Topology) -> ZeRO3:
        """With an int ``reshard_after_forward`` checked against the mesh
        (:func:`jddp._src.api.options.reshard_group`: ``1`` is ``False``, the shard count
        ``True``) and ``None`` made explicit."""
        in_host = topology.host_size if topology.two_level else None
        k = options.reshard_group(self.policy.resharding(), topology.shard_count, in_host)
        return type(self)(dataclasses.replace(self.policy, reshard_after_forward=k))

    def param_spec(self, topo: Topology, shape: Shape) -> P:
        """The partition spec of a parameter leaf of ``shape`` (split)."""
        return zero.leaf_spec(shape, topo.shard_count, topo.shard)

    def reduction(self, layout: zero.Layout, lv: Roles) -> zero.Sharded | None:
        """Each bucket reduce-scattered, its parameters gathered in the forward pass."""
        return zero.Sharded(layout, lv.shard_axis, lv.hybrid, bool(self.policy.resharding()),
                            self.policy.reshard_group, gathers=True,
                            owners=self.leaf_owners(layout))

    def trace_params(self, varying: Any, whole: Any) -> Any:
        """The parameters are pieces here: the loss is traced at shape structs of whole ones
        (without vma types: that ``shard_map`` is untyped)."""
        return whole

    def local_params(self, topo: Topology, lv: Roles, plan: BucketPlan, layout: zero.Layout,
                     chain: options.Chain, params: Any, varying: Any,
                     precision: precision_lib.MixedPrecision | None) -> tuple[Any, Bytes]:
        """Every bucket gathered once (chained, in first-use order), in the branch that needs
        them (so that a call that does not use them does not send them). Under a
        mixed-precision policy the pieces are cast to its ``param_dtype`` before the gather.

        Args:
          params: this device's pieces of the parameters.
        """
        pieces = jax.tree.leaves(precision_lib.compute_params(precision, params))
        from jddp._src.introspect import hlo  # the name's one definition; loaded at trace time

        # Each bucket's gather under its name, as the forward's (ddp.report files it there).
        scopes = [hlo.bucket_scope(b) for b in range(plan.num_buckets)] + [None]
        with recorder.recording(topo.axes.hosts) as rec:
            whole = zero.gather_buckets(pieces, layout, bucket_groups(plan)[::-1], topo.shard,
                                        gather_chain(chain), scopes[::-1])
        return jax.tree.unflatten(jax.tree.structure(params), whole), rec.sent

    def mark_not_resharded(self, plan: BucketPlan, traced: jaxpr_lib.Traced,
                           layout: zero.Layout) -> BucketPlan:
        """``plan`` with the gathered leaves that resharding cannot free (said at trace time,
        a warning, and in the plan)."""
        if not self.policy.resharding():
            return plan
        kept = zero.not_resharded(traced, layout, plan.unused)
        zero.warn_not_resharded(kept, plan.paths)
        return plan._replace(not_resharded=tuple(kept))

    def _whole(self, topo: Topology, chain: options.Chain, new: Any, layout: zero.Layout,
               plan: BucketPlan, grads: Any) -> Any:
        """The parameters stay in pieces: nothing to gather."""
        return new

    def update_sent(self, topo: Topology, plan: BucketPlan, layout: zero.Layout) -> Bytes:
        """None: the parameters stay in pieces."""
        return Bytes()


# The placement of each stage (the one place a stage number is read).
_STAGES: dict[int, type[ZeRO1]] = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
