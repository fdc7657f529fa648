"""Local SGD and DiLoCo: replicas that train apart for ``period`` steps, then average.

Pass one to :class:`jddp.DataParallel`::

    mesh = jddp.data_mesh(hosts="process")                 # one replica per host
    ddp = jddp.DataParallel(loss_fn, optax.adamw(1e-3), mesh=mesh,
                            sync=jddp.local_sgd.diloco(period=16))
    state = ddp.init(params)
    state, metrics = ddp.step(state, batch)       # no cross-host collective on 15 of 16
    eval_params = ddp.global_params(state)                 # DiLoCo's global parameters

Every other option of the step composes with it (accumulation, micro-batches, masks, ``rng``,
loss scaling, skipping, summed metrics, ``jddp.ZeRO`` inside each host); ``diloco(period,
fragments=F)`` is streaming DiLoCo. The policies are two classes: :class:`LocalSGD` (post-local
SGD, :func:`post_local_sgd`) and :class:`DiLoCo` (a ``LocalSGD`` whose averaging is the outer
step, :func:`diloco`). Under ``jddp-run --islands N`` the same script runs as N
islands that fail and rejoin, meeting at the outer step through torchft (docs/islands.md).
See docs/scaling.md for when to use which, and what each averages.
"""

from jddp._src.step.state import OuterState
from jddp._src.sync.islands import IslandDiLoCo, island_diloco, island_env
from jddp._src.sync.islands import status as island_status
from jddp._src.sync.local_sgd import DiLoCo, LocalSGD, diloco, post_local_sgd

__all__ = ["DiLoCo", "IslandDiLoCo", "LocalSGD", "OuterState", "diloco", "island_diloco",
           "island_env", "island_status", "post_local_sgd"]
