"""Per-example randomness (dropout) that does not depend on how the batch is sharded.

With ``jddp.DataParallel(loss_fn, tx, loss=jddp.Loss(rng=True))``, ``ddp.step(state, batch, rng=key)`` gives
``loss_fn(params, batch, rng)`` one key per example of its shard, derived from ``key``, the step
and the example's position in the global batch (:func:`example_keys`); :func:`per_example` makes a
Flax model's dropout draw from them. See ``docs/flax.md``.
"""

from jddp._src.data.rng import example_keys, per_example, step_key

__all__ = ["example_keys", "per_example", "step_key"]
