"""The user's loss function, as the trainer differentiates and reduces it.

``DataParallel`` accepts four shapes of ``loss_fn`` (``model_state`` present when ``init`` was given
one; ``weighted=True`` for per-example losses):

================================  ============================================================
call                              returns
================================  ============================================================
``loss_fn(params, batch)``        ``loss`` or, with ``has_aux``, ``(loss, metrics)``
``loss_fn(params, ms, batch)``    ``(loss, new_ms)`` or, with ``has_aux``,
                                  ``(loss, (new_ms, metrics))``
================================  ============================================================

``loss`` is the scalar mean over the device's shard, or with ``weighted=True`` the vector of
per-example losses of the shard (shape ``(local_batch,)``). ``metrics`` is a dict of scalars
(averaged over devices), and with ``weighted=True`` may also hold per-example vectors (averaged
over real examples).

:class:`Objective` turns any of them into one function ``fun(params, model_state, batch, weights)
-> (scalar, aux)`` for :func:`jddp.reduce.bucketed_value_and_grad`, the ``extras_fn`` that puts
metrics, the real-example count and the model-state payload on the last bucket's all-reduce, and
``finish``, which turns the reduced values into gradients, metrics and the new model state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jddp import model_state as ms_lib
from jddp.reduce import _check_scalar_loss

__all__ = ["Objective"]

_COUNT = "__count"


class Objective:
    """Adapts a user ``loss_fn`` for the trainer (see the module docstring).

    Args:
      loss_fn: the user's loss function.
      has_aux: whether it returns metrics.
      stateful: whether it takes and returns model state.
      sync: the model-state sync mode.
      weighted: whether it returns per-example losses, to be weighted by the mask.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        has_aux: bool,
        stateful: bool,
        sync: str,
        weighted: bool,
    ) -> None:
        self.loss_fn = loss_fn
        self.has_aux = has_aux
        self.stateful = stateful
        self.sync = ms_lib.check_sync_mode(sync)
        self.weighted = weighted

    # ------------------------------------------------------------------------------ the loss

    def _split(self, out: Any) -> tuple[Any, Any, dict]:
        """``(loss, new_model_state, metrics)`` from whatever ``loss_fn`` returned."""
        if not self.stateful:
            if not self.has_aux:
                return out, None, {}
            if not isinstance(out, tuple) or len(out) != 2:
                raise TypeError(
                    "With has_aux=True, loss_fn must return (loss, metrics), got "
                    f"{type(out).__name__}."
                )
            return out[0], None, out[1]
        form = "(loss, (new_model_state, metrics))" if self.has_aux else "(loss, new_model_state)"
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                "With model state (init(params, model_state=...)), loss_fn(params, model_state, "
                f"batch) must return {form}, got {type(out).__name__}."
            )
        if not self.has_aux:
            return out[0], out[1], {}
        if not isinstance(out[1], tuple) or len(out[1]) != 2:
            raise TypeError(
                f"With model state and has_aux=True, loss_fn must return {form}; the second "
                f"element is {type(out[1]).__name__}, not a (new_model_state, metrics) pair."
            )
        return out[0], out[1][0], out[1][1]

    def fun(self, params: Any, model_state: Any, batch: Any, weights: Any) -> tuple[Any, dict]:
        """The function differentiated: ``(scalar loss, aux)``.

        With ``weighted``, the scalar is ``sum(weights * losses) / local_batch``: the gradient is
        rescaled by ``local_batch / mean count`` after the reduction (see :meth:`finish`), so the
        local gradients have the magnitude of a mean loss while reduced (as hooks expect).
        """
        if self.stateful:
            out = self.loss_fn(params, model_state, batch)
        else:
            out = self.loss_fn(params, batch)
        loss, new_state, metrics = self._split(out)
        if self.stateful:
            ms_lib.check_same_state(model_state, new_state)
        if metrics is None:
            metrics = {}
        if not isinstance(metrics, dict):
            raise TypeError(
                "The metrics returned by loss_fn (has_aux=True) must be a dict of scalars, got "
                f"{type(metrics).__name__}."
            )
        if "loss" in metrics:
            raise ValueError("loss_fn's aux metrics must not use the key 'loss'.")
        aux = {"state": new_state}
        if not self.weighted:
            _check_scalar_loss(loss)
            for k, v in metrics.items():
                if jnp.shape(v) != ():
                    raise ValueError(
                        f"aux metric {k!r} has shape {jnp.shape(v)}; metrics must be scalars "
                        "(they are averaged over devices)."
                    )
            aux["metrics"] = {"loss": loss, **metrics}
            return loss, aux
        local = weights.shape[0]
        if jnp.shape(loss) != (local,) or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
            raise TypeError(
                "With weighted=True, loss_fn must return per-example losses: a float vector of "
                f"shape ({local},) for a device's shard of {local} examples, got "
                f"{jnp.result_type(loss)}{list(jnp.shape(loss))}. Return the unreduced losses; "
                "the trainer averages them over the real (mask=True) examples."
            )
        w = weights.astype(loss.dtype)
        # where(): a padded example's loss is dropped even if it is Inf/NaN (0 * Inf is NaN).
        total = jnp.sum(jnp.where(w != 0, w * loss, 0))
        sums = {"loss": total}
        for k, v in metrics.items():
            if jnp.shape(v) == (local,):
                vw = jnp.asarray(v).astype(jnp.float32)
                sums[k] = jnp.sum(jnp.where(w != 0, w.astype(jnp.float32) * vw, 0))
            elif jnp.shape(v) != ():
                raise ValueError(
                    f"aux metric {k!r} has shape {jnp.shape(v)}; with weighted=True metrics must "
                    f"be scalars or per-example vectors of shape ({local},)."
                )
        aux["metrics"] = {k: v for k, v in metrics.items() if jnp.shape(v) == ()}
        aux["sums"] = sums
        aux["count"] = jnp.sum(weights)
        return total / local, aux

    def plan_fun(self, params: Any, model_state: Any, batch: Any, weights: Any) -> Any:
        """Only the differentiated scalar: what the bucket planner traces."""
        return self.fun(params, model_state, batch, weights)[0]

    # ------------------------------------------------------------------------------ reduction

    def extras_fn(self, axis_name: Any, n: int) -> Callable[[Any, Any], dict]:
        """``extras_fn(loss, aux)``: everything averaged on the last bucket's all-reduce."""

        def extras(loss: Any, aux: dict) -> dict:
            del loss
            out = {"metrics": {k: jnp.asarray(v, jnp.float32) for k, v in aux["metrics"].items()}}
            if self.weighted:
                out["sums"] = aux["sums"]
                out[_COUNT] = aux["count"]
            if self.stateful:
                out["state"] = ms_lib.encode_state(aux["state"], self.sync, axis_name, n)
            return out

        return extras

    def finish(self, grads: Any, extras: Any, aux: dict, n: int, local: int) -> tuple:
        """Final gradients, metrics and the synchronised model state after the reduction.

        Args:
          grads: the reduced (averaged) gradients.
          extras: ``extras_fn``'s values averaged over the ``n`` replicas.
          aux: the local aux of :meth:`fun`.
          local: the per-device batch size.

        Returns:
          ``(grads, metrics, new_model_state)`` (the last ``None`` without model state).
        """
        metrics = dict(extras["metrics"])
        if self.weighted:
            mean_count = extras[_COUNT]
            # grads = mean_k(sum_k / local); the wanted gradient is sum_k(sum_k) / count.
            nonempty = mean_count > 0
            inv = jnp.where(nonempty, 1.0 / jnp.where(nonempty, mean_count, 1.0), 0.0)
            scale = local * inv
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
            for k, v in extras["sums"].items():
                metrics[k] = v * inv
        new_state = None
        if self.stateful:
            new_state = ms_lib.decode_state(extras["state"], aux["state"], self.sync, n)
        return grads, metrics, new_state
