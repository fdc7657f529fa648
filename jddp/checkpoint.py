"""Checkpoints of the whole TrainState (and the data loader's place) with orbax, from one process
or many.

Every array is saved with its sharding, so a restore continues exactly where the run stopped;
every process calls ``save``/``restore`` with the same arguments. A checkpoint of the older
per-feature ``TrainState`` layout restores into today's fields ([Checkpoints](../checkpoints.md)).

    mngr = jddp.checkpoint.manager("ckpt", max_to_keep=3)
    jddp.checkpoint.save(mngr, state)                       # at state.step
    state = jddp.checkpoint.restore(mngr, ddp.abstract_state(params))   # latest step

A training loop that survives failures and preemption (run it with ``jddp-run --max-restarts N``
or under any scheduler that re-runs it on exit status 75)::

    mngr = jddp.checkpoint.manager("ckpt", max_to_keep=3, save_interval_steps=100)
    loader = jddp.data.Loader(source, global_batch_size=256, mesh=mesh)
    state = jddp.checkpoint.restore_or_init(mngr, ddp, params, loader=loader)  # or fresh
    for step in range(int(state.step), num_steps):
        batch, mask = next(loader)                               # the exact next example
        state, metrics = ddp.step(state, batch, mask=mask)
        jddp.checkpoint.save_if_due(mngr, state, step=step + 1, loader=loader)
    jddp.checkpoint.wait(mngr)                          # the last write is on disk

``save_if_due`` saves every 100 steps and, after a SIGTERM, at one step on every process, then
exits with 75. The loader's state (a small JSON dict, :meth:`jddp.data.Loader.state`) is a second
item of the same checkpoint, so the TrainState and the data position are committed together.

With ``manager(..., async_save=True)`` saves are asynchronous (see the guide for when that is
safe); :func:`save` waits for its write unless ``wait=False``.
"""

from jddp._src.runtime.checkpoint import (
    manager,
    restore,
    restore_or_init,
    save,
    save_if_due,
    wait,
)

__all__ = ["manager", "restore", "restore_or_init", "save", "save_if_due", "wait"]
