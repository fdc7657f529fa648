"""The one single-device reference trainer the tests compare data-parallel runs with.

Plain JAX on one device: ``jax.grad`` of the loss on the whole global batch and an optax update,
nothing of jddp but :func:`jddp.random.example_keys` (the documented per-example keys). Options
mirror what a ``DataParallel`` step means:

- ``windows``: a list of steps, each a list of the calls (micro-batches) of one accumulation
  window; the step's gradient is the mean of the calls' gradients (equal shapes);
- ``weighted``: ``loss_fn`` returns per-example losses and the objective is their mean weighted
  by ``masks`` (``sum(m l) / sum(m)``; all ones without a mask);
- ``pooled``: with ``weighted``, a window's calls pool their real examples (the window's
  ``sum(m l) / sum(m)`` over all its calls, what ``DataParallel(loss=Loss(weighted=True),
  accumulate=Accumulate(steps=k))`` means), so calls of different sizes or mask sums (an epoch's short last
  window) weigh by their real rows, not as equal means;
- ``rng_key``: ``loss_fn(params, batch, keys)`` with the keys of ``example_keys``;
- ``model_state``: ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``, the state
  taken from the whole batch (what ``model_state_sync="broadcast"`` gives for batch-independent
  updates, and ``"mean"`` for updates linear in the batch);
- ``param_dtype``: mixed precision (``MixedPrecision(param_dtype=...)``): the loss computes with
  the float32 parameters cast to it, gradients come back (through the cast) and are averaged and
  applied in float32;
- ``shards``: each call's gradient is the mean of the gradients of ``shards`` equal slices of its
  batch (what N devices compute before their float32 reduction: in a low ``param_dtype`` a
  weight gradient summed over a slice rounds differently from one summed over the whole batch);
- :func:`local_sgd` simulates the replicas of post-local SGD and DiLoCo (one per device on a 1-D
  mesh, one per host on a two-level one) on their slices of each global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jddp


class Result(NamedTuple):
    """What a reference run returns: the final parameters and one loss per step (the mean of
    its calls' losses)."""

    params: Any
    losses: list[float]
    model_state: Any = None


def _objective(loss_fn, weighted, rng_key, stateful, param_dtype=None):
    """``objective(params, model_state, batch, mask, step, call) -> (loss, new_model_state)``."""

    def objective(params, model_state, batch, mask, step, call):
        if param_dtype is not None:
            params = jax.tree.map(lambda w: w.astype(param_dtype), params)
        args: list[Any] = [params]
        if stateful:
            args.append(model_state)
        args.append(batch)
        if rng_key is not None:
            n = len(jax.tree.leaves(batch)[0])
            args.append(jddp.random.example_keys(rng_key, step, n, call=call))
        out = loss_fn(*args)
        loss, new_state = out if stateful else (out, None)
        if weighted:
            m = jnp.ones(loss.shape, loss.dtype) if mask is None else jnp.asarray(mask, loss.dtype)
            loss = jnp.sum(m * loss) / jnp.sum(m)
        return loss, new_state

    return objective


def _sharded_grad(grad_fn, params, batch, step, call, shards):
    """The mean loss and gradient of ``shards`` equal slices of ``batch``."""
    n = len(jax.tree.leaves(batch)[0]) // shards
    parts = [grad_fn(params, None, jax.tree.map(lambda x, i=i: x[i * n:(i + 1) * n], batch),
                     None, step, call) for i in range(shards)]
    loss = sum(p[0][0] for p in parts) / shards
    return loss, jax.tree.map(lambda *xs: sum(xs) / shards, *(p[1] for p in parts))


def _update(optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    """``update(grads, opt_state, params) -> (params, opt_state)``: the optax update and its
    application as one compiled program (run eagerly, each of the optimizer's operations compiles
    a program of its own, and a ``lax.scan`` inside it, such as Muon's Newton-Schulz, compiles
    again on every step)."""

    @jax.jit
    def update(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def train(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    params: Any,
    windows: Sequence[Sequence[Any]],
    *,
    masks: Sequence[Sequence[Any]] | None = None,
    weighted: bool = False,
    rng_key: jax.Array | None = None,
    model_state: Any = None,
    pooled: bool = False,
    param_dtype: Any = None,
    shards: int = 1,
) -> Result:
    """Trains ``params`` on one device, one optax update per window of calls.

    Args:
      windows: per step, the global batches of its calls (``[[b] for b in batches]`` for plain
        steps).
      masks: per step and call, the example weights (``weighted=True`` only).
      weighted: ``loss_fn`` returns per-example losses (see the module docstring).
      rng_key: the key passed to every ``ddp.step(..., rng=key)``.
      model_state: the initial model state, for ``loss_fn(params, model_state, batch)``.
      pooled: weigh a window's calls by their real rows (see the module docstring).
      param_dtype: compute with the parameters cast to this dtype (mixed precision).
      shards: average the gradients of this many slices of each call's batch (see above).
    """
    if pooled and not weighted:
        raise ValueError("pooled=True pools weighted calls: pass weighted=True")
    stateful = model_state is not None
    objective = _objective(loss_fn, weighted, rng_key, stateful, param_dtype)
    grad_fn = jax.jit(jax.value_and_grad(objective, has_aux=True))
    update = _update(optimizer)
    opt_state = optimizer.init(params)
    losses = []
    for step, window in enumerate(windows):
        grads, total, rows = None, 0.0, 0.0
        for call, batch in enumerate(window):
            mask = None if masks is None else masks[step][call]
            if shards > 1:
                assert mask is None and not stateful and rng_key is None, "shards: plain only"
                loss, g = _sharded_grad(grad_fn, params, batch, step, call, shards)
                new_state = None
            else:
                (loss, new_state), g = grad_fn(params, model_state, batch, mask, step, call)
            # pooled: the call's sum(m l) and its gradient (its weighted mean times sum(m)).
            w = 1.0 if not pooled else float(np.sum(
                np.ones(len(jax.tree.leaves(batch)[0])) if mask is None else mask))
            g = jax.tree.map(lambda x, w=w: x * w, g)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            total += float(loss) * w
            rows += w
            if stateful:
                model_state = new_state
        k = rows if pooled else len(window)
        grads = jax.tree.map(lambda x, k=k: x / k, grads)
        params, opt_state = update(grads, opt_state, params)
        losses.append(total / k)
    return Result(params, losses, model_state)


def local_sgd(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    params: Any,
    batches: Sequence[Any],
    *,
    replicas: int,
    period: int,
    outer: optax.GradientTransformation | None = None,
) -> Result:
    """Post-local SGD (``outer=None``, ``start_step=0``: average the parameters after the update
    of steps 0, ``period``, ...) or DiLoCo (``outer``: after every ``period`` inner steps, the
    outer optimizer on ``global - mean(replicas)``, and every replica restarts from the new
    global parameters). Replica ``r`` trains on rows ``r/R .. (r+1)/R`` of each global batch
    with its own optimizer state; returns the mean of the replicas' parameters (post-local SGD)
    or the global parameters (DiLoCo)."""
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    inner = _update(optimizer)
    outer_update = _update(outer) if outer is not None else None
    reps = [params] * replicas
    states = [optimizer.init(params) for _ in range(replicas)]
    glob, outer_state = params, (outer.init(params) if outer is not None else None)
    losses = []
    for step, batch in enumerate(batches):
        n = len(jax.tree.leaves(batch)[0]) // replicas
        total = 0.0
        for r in range(replicas):
            part = jax.tree.map(lambda x, r=r, n=n: x[r * n:(r + 1) * n], batch)
            loss, g = grad_fn(reps[r], part)
            reps[r], states[r] = inner(g, states[r], reps[r])
            total += float(loss)
        losses.append(total / replicas)
        mean = jax.tree.map(lambda *xs: sum(xs) / replicas, *reps)
        if outer is None and step % period == 0:
            reps = [mean] * replicas
        elif outer is not None and (step + 1) % period == 0:
            delta = jax.tree.map(jnp.subtract, glob, mean)
            glob, outer_state = outer_update(delta, outer_state, glob)
            reps = [glob] * replicas
    final = glob if outer is not None else jax.tree.map(lambda *xs: sum(xs) / replicas, *reps)
    return Result(final, losses)


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between two trees of arrays."""
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)),
                            initial=0.0)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                          strict=True))
