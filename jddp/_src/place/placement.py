"""Where the training state lives: one policy, :class:`Replicate` (DDP) or :class:`ZeRO`.

The step never asks for a ZeRO stage. Every decision that depends on where parameters, gradients
and optimizer state live is a method of the ``place`` policy (FSDP2's policy objects, e.g. its
``OffloadPolicy`` / ``CPUOffloadPolicy``, the first of which is "nothing to do"):
:class:`Replicate`'s methods are the replicated paths, :class:`ZeRO`'s the sharded ones. The
methods take the pieces of the step they need (the :class:`jddp._src.runtime.topology.Topology`, the
parameters' :class:`jddp._src.place.zero.Layout`, the bucket plan), never the step's configuration:

- partition specs of the parameters, the optimizer state and the reduced gradients, and the
  zeros a non-synchronising call returns for the latter (:meth:`ZeRO.param_spec`,
  :meth:`ZeRO.opt_spec`, :meth:`ZeRO.grad_specs`, :meth:`ZeRO.grad_zeros`);
- the sharded reduction's record (:class:`jddp._src.reduce.sharded.Sharded`, or ``None`` for the
  hook's all-reduce), whether ``shard_map`` can be typed (``check_vma``), the parameters the
  loss is traced at and local gradients are taken at, the plan's not-resharded leaves;
- the optimizer update (each device updates its pieces, stages 1-2 then all-gather them) and
  the bytes that gather sends;
- the optimizer state's memory between steps (``offload``: :mod:`jddp._src.place.offload`).

The collectives themselves are :mod:`jddp._src.place.zero`'s; this module decides which run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp._src.api import options
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.introspect import vma
from jddp._src.place import offload, owner, zero
from jddp._src.plan.planner import BucketPlan
from jddp._src.reduce.bytemodel import Bytes, ring
from jddp._src.reduce.chain import chain_dependency, resolve_chain
from jddp._src.reduce.sharded import Sharded
from jddp._src.runtime.topology import Roles, Topology
from jddp._src.update import precision as precision_lib

Shape = Sequence[int]


# ------------------------------------------------------------------ helpers of the sharded paths


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


def bucket_groups(plan: BucketPlan) -> list[tuple[int, ...]]:
    """The buckets' leaves, then the unused leaves (which are in no bucket)."""
    return [b.indices for b in plan.buckets] + [tuple(plan.unused)]


def gather_chain(chain: options.Chain) -> Any:
    """How consecutive all-gathers are kept apart: the reduction's ``chain`` applied to pieces,
    an always-zero add (as for the sharded stages' reduce-scatters) unless ``Buckets(chain="none")``."""
    mode = resolve_chain(chain)
    if mode != "none":
        def add(prev: list, pieces: list) -> list:
            dep = chain_dependency(prev, "add")
            return [p + dep.astype(p.dtype) for p in pieces]
        return add
    return None


def gather_bytes(topo: Topology, lv: Roles, plan: BucketPlan, layout: zero.Layout,
                 dtype: Any = None) -> Bytes:
    """Bytes of one all-gather of every split parameter over the shard axis
    (:func:`gather_params`, and stage 3's whole parameters for local gradients), in ``dtype``
    (``None``: the parameters' own)."""
    hosts_axis = topo.axes.hosts
    spans = hosts_axis is not None and hosts_axis in vma.axis_names(lv.shard_axis)
    hosts = int(topo.mesh.shape[hosts_axis]) if spans else 1
    dtypes = plan.dtypes if dtype is None else [dtype] * len(plan.dtypes)
    pieces = zero.split_bytes(layout, dtypes, range(len(plan.shapes)))
    return ring("all-gather", pieces, layout.n, hosts)


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
    link = gather_chain(chain)
    after_leaves = jax.tree.leaves(after)
    after_specs = [zero.leaf_spec(s, topo.shard_count, topo.shard) for s in
                   (jnp.shape(x) for x in after_leaves)]

    def local(xs: list, wait: list) -> list:
        if wait and link is not None:
            first = next((g for g in bucket_groups(plan)
                          if any(layout.dims[i] is not None for i in g)), ())
            idx = [i for i in first if layout.dims[i] is not None]
            waited = link(wait, [xs[i] for i in idx])
            xs = list(xs)
            for i, x in zip(idx, waited, strict=True):
                xs[i] = x
        return zero.gather_buckets(xs, layout, bucket_groups(plan), topo.shard, link)

    gathered = jax.shard_map(
        local, mesh=topo.mesh, in_specs=(specs, after_specs), out_specs=P(), check_vma=False,
    )(leaves, after_leaves)
    return jax.tree.unflatten(treedef, gathered)


def _constrain(mesh: Mesh, tree: Any, specs: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), tree, specs,
        is_leaf=lambda x: x is None,
    )


# ------------------------------------------------------------------------------ the policies

# ZeRO's options, named when given to Replicate.
_ZERO_OPTIONS = frozenset({"stage", "reshard_after_forward", "hybrid", "offload", "shard"})


@dataclasses.dataclass(frozen=True, init=False)
class Replicate:
    """Every device holds the whole parameters, gradients and optimizer state (DDP).

    Its methods are the replicated paths of the step (the same signatures as :class:`ZeRO`'s).
    """

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

    @property
    def sharded(self) -> bool:
        """Whether some state is sharded (also the jit's ``sharded`` compiler option)."""
        return False

    @property
    def check_vma(self) -> bool:
        """Whether the per-device step's ``shard_map`` can be typed (``check_vma``)."""
        return True

    @property
    def splits_params(self) -> bool:
        """Whether each device holds only its piece of every split parameter leaf."""
        return False

    def topology(self, mesh: Mesh, *, islands: bool = False) -> Topology:
        """The roles of ``mesh`` for a step placed so (``islands``: local SGD's replicas)."""
        return Topology.of(mesh, islands=islands)

    def resolve(self, topology: Topology) -> Replicate:
        """This policy checked against the mesh (nothing to resolve)."""
        return self

    def param_spec(self, topo: Topology, shape: Shape) -> P:
        """The partition spec of a parameter leaf of ``shape`` (replicated)."""
        return P()

    def opt_spec(self, topo: Topology, shape: Shape) -> P:
        """The partition spec of an optimizer-state leaf of ``shape`` (replicated)."""
        return P()

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

    def reduction(self, layout: zero.Layout, lv: Roles) -> Sharded | None:
        """The sharded reduction's record (``None``: the hook's all-reduce)."""
        return None

    def trace_params(self, varying: Any, whole: Any) -> Any:
        """The parameters the loss is traced at: this device's (varying) ones."""
        return varying

    def local_params(self, topo: Topology, lv: Roles, plan: BucketPlan, layout: zero.Layout,
                     chain: options.Chain, params: Any, varying: Any,
                     precision: precision_lib.MixedPrecision | None) -> tuple[Any, Bytes]:
        """The parameters local gradients are taken at (``varying``) and the bytes of getting
        them (none)."""
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

    def update_bytes(self, topo: Topology, lv: Roles, plan: BucketPlan,
                     layout: zero.Layout) -> Bytes:
        """Bytes sent after the update to make the parameters whole again (none)."""
        return Bytes()

    def owners(self, topo: Topology, params: Any) -> owner.OwnerPlan | None:
        """Each leaf's owner device (``None``: no owners at this placement)."""
        return None


@dataclasses.dataclass(frozen=True)
class ZeRO:
    """Sharded data parallelism (ZeRO; FSDP's ``FULL_SHARD`` at stage 3).

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
        The state is stored as with ``"even"``.
    """

    stage: int = 3
    reshard_after_forward: bool | int | None = None
    hybrid: bool = False
    offload: bool = False
    shard: str = "even"

    def __post_init__(self) -> None:
        stage = self.stage
        if isinstance(stage, bool) or not isinstance(stage, int | np.integer) \
                or stage not in (1, 2, 3):
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

    def resharding(self) -> bool | int:
        """``reshard_after_forward`` resolved: ``None`` is ``True`` at stage 3, else ``False``;
        a bool or a group size ``k`` only at stage 3."""
        return options.reshard_after_forward(self.reshard_after_forward, self.stage)

    @property
    def reshard_group(self) -> int | None:
        """The group size of ZeRO++'s hpZ (an int ``reshard_after_forward``), else ``None``."""
        k = self.resharding()
        return None if isinstance(k, bool) else k

    @property
    def sharded(self) -> bool:
        """Whether some state is sharded (also the jit's ``sharded`` compiler option)."""
        return True

    @property
    def check_vma(self) -> bool:
        """Whether the per-device step's ``shard_map`` can be typed: not from stage 2, whose
        reduce-scatter returns values vma types cannot express as replicated (whole leaves and
        metrics riding on it); that ``shard_map`` is untyped, like pmap, which the bucket hooks
        support (they do the only reduction either way)."""
        return self.stage < 2

    @property
    def splits_params(self) -> bool:
        """Whether each device holds only its piece of every split parameter leaf (stage 3)."""
        return self.stage >= 3

    def topology(self, mesh: Mesh, *, islands: bool = False) -> Topology:
        """The roles of ``mesh`` for a step placed so (``islands``: local SGD's replicas)."""
        # hybrid's needs (a two-level mesh) are a row of jddp._src.step.compat.
        return Topology.of(mesh, hybrid=self.hybrid, sharded=True, islands=islands)

    def resolve(self, topology: Topology) -> ZeRO:
        """This policy with an int ``reshard_after_forward`` checked against the mesh
        (:func:`jddp._src.api.options.reshard_group`: ``1`` is ``False``, the shard count ``True``)
        and ``None`` made explicit at stage 3."""
        if self.stage < 3:
            return self
        in_host = topology.host_size if topology.two_level else None
        k = options.reshard_group(self.resharding(), topology.shard_count, in_host)
        return dataclasses.replace(self, reshard_after_forward=k)

    def param_spec(self, topo: Topology, shape: Shape) -> P:
        """The partition spec of a parameter leaf of ``shape`` (split at stage 3)."""
        if self.stage < 3:
            return P()
        return zero.leaf_spec(shape, topo.shard_count, topo.shard)

    def opt_spec(self, topo: Topology, shape: Shape) -> P:
        """The partition spec of an optimizer-state leaf of ``shape`` (split)."""
        return zero.leaf_spec(shape, topo.shard_count, topo.shard)

    def stored(self, shardings: Any) -> Any:
        """A state's ``NamedSharding`` s as it is kept between steps: with ``offload``, the
        optimizer state's in host memory."""
        return offload.place(shardings) if self.offload else shardings

    def device_view(self, state: Any) -> Any:
        """The state the per-device phases take: they never read the optimizer state, so
        offloaded it stays on the host."""
        return state.replace(opt_state=None) if self.offload else state

    def fetch(self, state: Any) -> Any:
        """Inside the step, the state as the update reads it: with ``offload`` the optimizer
        state comes from host memory."""
        return offload.fetch(state) if self.offload else state

    def store(self, state: Any) -> Any:
        """Inside the step, the new state as it is kept between steps: with ``offload`` the
        optimizer state goes back to host memory."""
        return offload.store(state) if self.offload else state

    def grad_specs(self, topo: Topology, layout: zero.Layout, params: Any, rep: P) -> Any:
        """Out specs of the reduced gradients: from stage 2 they come in pieces (after ``rep``,
        the replica axis with local SGD)."""
        if self.stage < 2:
            return rep
        return jax.tree.map(lambda s: P(*rep, *s), layout.specs(params, topo.shard),
                            is_leaf=lambda x: isinstance(x, P))

    def grad_zeros(self, params: Any, layout: zero.Layout) -> Any:
        """The reduced gradients of a call that does not synchronise: zeros, in this device's
        pieces from stage 2."""
        if self.stage < 2:
            return jax.tree.map(jnp.zeros_like, params)
        return jax.tree.unflatten(jax.tree.structure(params), [
            jnp.zeros(zero.shard_shape(s, d, layout.n), jnp.result_type(x)) for s, d, x in
            zip(layout.shapes, layout.dims, jax.tree.leaves(params), strict=True)
        ])

    def reduction(self, layout: zero.Layout, lv: Roles) -> Sharded | None:
        """The sharded reduction's record from stage 2 (``None`` at stage 1: the hook's
        all-reduce)."""
        if self.stage < 2:
            return None
        return Sharded(self.stage, layout, lv.shard_axis, lv.hybrid, bool(self.resharding()),
                       self.reshard_group)

    def trace_params(self, varying: Any, whole: Any) -> Any:
        """The parameters the loss is traced at: at stage 3 the parameters are pieces here, so
        shape structs of whole ones (without vma types: that ``shard_map`` is untyped)."""
        return whole if self.stage >= 3 else varying

    def local_params(self, topo: Topology, lv: Roles, plan: BucketPlan, layout: zero.Layout,
                     chain: options.Chain, params: Any, varying: Any,
                     precision: precision_lib.MixedPrecision | None) -> tuple[Any, Bytes]:
        """The parameters local gradients (earlier micro-batches, no-sync calls) are taken at,
        and the bytes of getting them: stage 3 gathers every bucket once (chained, in first-use
        order), in the branch that needs them (so that a call that does not use them does not
        send them). Under a mixed-precision policy the pieces are cast to its ``param_dtype``
        before the gather.

        Args:
          params: this device's parameters (pieces at stage 3); ``varying``: as typed for local
            gradients (whole below stage 3).
        """
        if self.stage < 3:
            return varying, Bytes()
        pieces = jax.tree.leaves(precision_lib.compute_params(precision, params))
        from jddp._src.introspect import hlo  # the name's one definition; loaded at trace time

        # Each bucket's gather under its name, as the forward's (ddp.report files it there).
        scopes = [hlo.bucket_scope(b) for b in range(plan.num_buckets)] + [None]
        whole = zero.gather_buckets(pieces, layout, bucket_groups(plan)[::-1], topo.shard,
                                    gather_chain(chain), scopes[::-1])
        return (jax.tree.unflatten(jax.tree.structure(params), whole),
                gather_bytes(topo, lv, plan, layout, precision_lib.gather_dtype(precision)))

    def mark_not_resharded(self, plan: BucketPlan, traced: jaxpr_lib.Traced,
                           layout: zero.Layout) -> BucketPlan:
        """``plan`` with the gathered leaves that stage 3's resharding cannot free (said at trace
        time, a warning, and in the plan)."""
        if self.stage < 3 or not self.resharding():
            return plan
        kept = zero.not_resharded(traced, layout, plan.unused)
        zero.warn_not_resharded(kept, plan.paths)
        return plan._replace(not_resharded=tuple(kept))

    def update(self, optimizer: optax.GradientTransformation, topo: Topology,
               layout: zero.Layout, plan: BucketPlan, chain: options.Chain, params: Any,
               opt_state: Any, grads: Any, record: Any = None) -> tuple[Any, Any]:
        """``(new_params, new_opt_state)`` of one replica: each device updates its pieces.

        The update runs in the global view on leaves of their true shapes, so any optax
        transformation works unchanged (XLA adds the collectives a global norm or a factored
        moment needs). Stages 1 and 2 then all-gather the updated pieces, one all-gather per
        bucket (:func:`gather_params`). With ``shard="owner"`` each leaf is updated on its
        owner (:func:`jddp._src.place.owner.update`), which tells ``record`` (when not ``None``)
        the bytes it sends once traced: they depend on the optimizer state, which
        :meth:`update_bytes` does not see.
        """
        if self.shard == "owner":
            return owner.update(self.stage, optimizer, topo, layout, plan, params, opt_state,
                                grads, record)
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
        if self.stage < 3:
            last = [jax.tree.leaves(grads)[i] for i in (plan.buckets[-1].indices
                                                        if plan.buckets else ())]
            new = gather_params(topo, chain, new, layout, plan, after=last)
        return new, opt_state

    def update_bytes(self, topo: Topology, lv: Roles, plan: BucketPlan,
                     layout: zero.Layout) -> Bytes:
        """Bytes sent after the update to make the parameters whole again: stages 1-2's
        all-gather of the updated pieces (:func:`gather_params`); none at stage 3, and none
        here with ``shard="owner"``: :meth:`update` records its bytes when traced."""
        if self.stage >= 3 or self.shard == "owner":
            return Bytes()
        return gather_bytes(topo, lv, plan, layout)

    def owners(self, topo: Topology, params: Any) -> owner.OwnerPlan | None:
        """With ``shard="owner"``, each leaf's owner device (:func:`jddp._src.place.owner.plan`),
        else ``None``."""
        return owner.plan(params, topo.shard_count) if self.shard == "owner" else None


Place = Replicate | ZeRO
