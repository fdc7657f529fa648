"""The user's loss function, as the step differentiates and reduces it.

:func:`unpack_loss_output` is the one reader of the ``loss_fn`` forms ``jddp.DataParallel``
documents; :class:`Objective` turns every form into one function ``(params, model_state, batch,
weights) -> (scalar, LocalAux)``. Every mean the step reports is a ratio of sums over devices and
micro-batches that rides on the last bucket's all-reduce (:class:`Extras`); the gradient is divided
by the same denominator after the reduction (division is linear).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jddp._src.api import options
from jddp._src.data import rng as rng_lib
from jddp._src.step.checks import check_mask, check_scalar_loss
from jddp._src.sync import model_state as ms_lib
from jddp._src.tree import broadcast_to_devices

# Every metric the step writes itself, whatever its options (one list: the user's aux metrics may
# not take these names, and tests/test_metrics.py lowers each kind of step and checks that it
# writes no other name). Optimizer hyperparameters are checked where they are added.
STEP_METRICS: dict[str, str] = {
    "loss": "the mean loss of this call's examples, over every device (as its aux metrics)",
    "window_loss": "the mean loss of the accumulation window a sync call closes (Accumulate.steps > 1)",
    "comm_bytes": "bytes this device sent in the step's collectives",
    "comm_bytes_hosts": "of those, bytes sent across hosts (two-level mesh)",
    "skipped": "1.0 when the update was skipped (loss_scale=; Loss.weighted: no real row)",
    "synced": "whether the call reduced gradients (Accumulate.steps > 1)",
    "loss_scale": "the loss scale this call used (loss_scale=...)",
    "averaged": "whether the step averaged the replicas (local SGD sync=)",
    "local_loss": "per device: this call's own loss (Accumulate.steps > 1)",
    "replica_loss": "per replica: its loss before averaging (local SGD sync=)",
}


def check_loss_arity(loss_fn: Callable[..., Any], n: int, *, stateful: bool, rng: bool,
                     first: str = "params") -> None:
    """Refuses a ``loss_fn`` that cannot take the ``n`` arguments the step passes, naming the
    expected call and the option that decides each argument (a bare "takes 2 positional
    arguments but 3 were given" names neither); ``first``: the name of its first argument."""
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some C callables have none: trust them
        return
    try:
        sig.bind(*range(n))
    except TypeError:
        pass
    else:
        return
    call = ", ".join([first] + ["model_state"] * stateful + ["batch"] + ["rng"] * rng)
    why = []
    if stateful:
        why.append("model_state because the state was made with init(params, model_state) "
                   "(a model without state: init(params))")
    if rng:
        why.append("rng, as loss=jddp.Loss(rng=True) passes one PRNG key per example")
    because = f"; it passes {' and '.join(why)}" if why else ""
    more = (" Add the argument (and draw dropout keys from it), or drop Loss(rng=True) for a "
            "loss without keys." if rng else " A loss that takes per-example keys as its last "
            "argument needs loss=jddp.Loss(rng=True).")
    raise TypeError(
        f"The step calls loss_fn({call}){because}, but loss_fn{sig} cannot take these "
        f"arguments. Give loss_fn that signature, or change the option.{more}"
    )


class LossOutput(NamedTuple):
    """What a ``loss_fn`` returned, in one form."""

    loss: Any
    model_state: Any
    metrics: dict


def unpack_loss_output(out: Any, *, has_aux: bool, stateful: bool) -> LossOutput:
    """Reads ``loss_fn``'s output in the forms ``jddp.DataParallel`` documents."""
    if not stateful:
        if not has_aux:
            return LossOutput(out, None, {})
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                f"With jddp.Loss(has_aux=True), loss_fn must return (loss, metrics), got "
                f"{type(out).__name__}."
            )
        return LossOutput(out[0], None, out[1])
    form = "(loss, (new_model_state, metrics))" if has_aux else "(loss, new_model_state)"
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(
            "With model state (init(params, model_state=...)), loss_fn(params, model_state, "
            f"batch) must return {form}, got {type(out).__name__}."
        )
    if not has_aux:
        return LossOutput(out[0], out[1], {})
    if not isinstance(out[1], tuple) or len(out[1]) != 2:
        raise TypeError(
            f"With model state and jddp.Loss(has_aux=True), loss_fn must return {form}; the "
            f"second "
            f"element is {type(out[1]).__name__}, not a (new_model_state, metrics) pair."
        )
    return LossOutput(out[0], out[1][0], out[1][1])


class LocalAux(NamedTuple):
    """One device's values for one micro-batch, besides the differentiated scalar.

    Attributes:
      sums: numerators of ratio metrics: ``"loss"`` and, with ``weighted``, loss-shaped metrics.
      weight: the denominator of every ratio: 1, or with ``weighted`` the real examples' weight.
    """

    model_state: Any
    metrics: dict
    sums: dict
    weight: Any


class Extras(NamedTuple):
    """What rides on the last bucket's all-reduce (local values in, means over devices out).

    Fields the same on every device are not sent (``None``): without ``weighted`` every
    micro-batch weighs 1, so the window's weight is a count the host knows.
    """

    metrics: dict
    sums: dict
    weight: Any
    window_loss: Any
    window_weight: Any
    state: Any


def _f32(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Objective:
    """A user ``loss_fn`` as the step differentiates it (``policy``: its :class:`Loss`)."""

    loss_fn: Callable[..., Any]
    stateful: bool
    policy: Loss

    def __call__(
        self, params: Any, model_state: Any, batch: Any, weights: Any, rng: Any = None
    ) -> tuple:
        """``(scalar, LocalAux)``: the differentiated scalar and everything else, locally.

        With ``weighted``, the scalar is ``sum(weights * losses) / weights.size`` (the gradient is
        divided by the reduced weight later), so local gradients have the magnitude of a mean loss
        while they are reduced, as hooks expect.
        """
        args = (params, model_state, batch) if self.stateful else (params, batch)
        args = (*args, rng) if self.policy.rng else args
        check_loss_arity(self.loss_fn, len(args), stateful=self.stateful, rng=self.policy.rng)
        out = self.loss_fn(*args)
        loss, new_state, metrics = unpack_loss_output(
            out, has_aux=self.policy.has_aux, stateful=self.stateful
        )
        if self.stateful:
            ms_lib.check_same_state(model_state, new_state)
        metrics = _check_metrics(metrics)
        missing = [k for k in self.policy.sum_metrics if k not in metrics]
        if missing:
            raise ValueError(
                f"Loss.sum_metrics names {missing}, but loss_fn's metrics are "
                f"{sorted(metrics)}; return them in the aux dict or remove them from "
                "jddp.Loss(sum_metrics=...)."
            )
        if not self.policy.weighted:
            check_scalar_loss(loss)
            for k, v in metrics.items():
                if jnp.shape(v) != ():
                    raise ValueError(
                        f"aux metric {k!r} has shape {jnp.shape(v)}; metrics must be scalars "
                        "(they are averaged over devices)."
                    )
            aux = LocalAux(new_state, {k: _f32(v) for k, v in metrics.items()},
                           {"loss": _f32(loss)}, jnp.ones((), jnp.float32))
            return loss, aux
        shape = jnp.shape(weights)
        if jnp.shape(loss) != shape or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
            raise TypeError(
                "With jddp.Loss(weighted=True), loss_fn must return the unreduced losses, shaped "
                "like the "
                f"mask: a float array of shape {tuple(shape)} for a device's shard, got "
                f"{jnp.result_type(loss)}{list(jnp.shape(loss))}. Return the per-example (or "
                "per-token) losses; the step averages them over the real (mask != 0) entries."
            )
        size = self.unit(weights)
        w = weights.astype(loss.dtype)
        # where(): a padded example's loss is dropped even if it is Inf/NaN (0 * Inf is NaN).
        total = jnp.sum(jnp.where(w != 0, w * loss, 0))
        sums = {"loss": _f32(total) / size}
        scalars = {}
        for k, v in metrics.items():
            if jnp.shape(v) == shape:
                wv = w.astype(jnp.float32) * _f32(v)
                if k in self.policy.sum_metrics:  # a total over the real entries, e.g. a token count
                    scalars[k] = jnp.sum(jnp.where(w != 0, wv, 0))
                    continue
                sums[k] = jnp.sum(jnp.where(w != 0, wv, 0)) / size
            elif jnp.shape(v) == ():
                scalars[k] = _f32(v)
            else:
                raise ValueError(
                    f"aux metric {k!r} has shape {jnp.shape(v)}; with jddp.Loss(weighted=True) "
                    f"metrics must be scalars or arrays shaped like the loss {tuple(shape)}."
                )
        weight = jnp.sum(weights.astype(jnp.float32)) / size
        return total / size, LocalAux(new_state, scalars, sums, weight)

    def unit(self, weights: Any) -> float:
        """The static normaliser of one micro-batch's sums: its weights' size, or 1.

        Calls of one window may differ in shape (a padded last batch), so the accumulator holds
        plain sums multiplied back by this unit: every real entry weighs the same in the window.
        """
        return float(max(1, int(jnp.size(weights)))) if self.policy.weighted else 1.0

    def extras(self, aux: LocalAux, window_loss: Any, window_weight: Any, axis_name: Any,
               n: int, windowed: bool = False) -> Extras:
        """The local values to average on the last bucket's all-reduce.

        Args:
          windowed: the window spans calls: this call's own loss numerator rides along too, so
            ``metrics["loss"]`` covers this call and ``metrics["window_loss"]`` the window.
        """
        state = ()
        if self.stateful:
            state = ms_lib.encode_state(aux.model_state, self.policy.model_state_sync, axis_name, n)
        if not self.policy.weighted:
            metrics = {**aux.metrics, "loss": aux.sums["loss"]} if windowed else aux.metrics
            return Extras(metrics, {}, None, window_loss, None, state)
        sums = {k: v for k, v in aux.sums.items() if windowed or k != "loss"}
        return Extras(aux.metrics, sums, aux.weight, window_loss, window_weight, state)

    def extras_shape(self, aux_shape: LocalAux, n: int, axis_name: Any,
                     windowed: bool = False) -> Extras:
        """Shape structs of :meth:`extras` for a :class:`LocalAux` of shape structs ``aux_shape``."""
        scalar = jnp.zeros((), jnp.float32)
        return jax.eval_shape(
            lambda aux: self.extras(aux, scalar, scalar, axis_name, n, windowed), aux_shape)

    def decode_state(self, mean: Extras, local_state: Any, n: int) -> Any:
        """The synchronised new model state from the averaged payload."""
        if not self.stateful:
            return None
        return ms_lib.decode_state(mean.state, local_state, self.policy.model_state_sync, n)


def _check_metrics(metrics: Any) -> dict:
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise TypeError(
            "The metrics returned by loss_fn (jddp.Loss(has_aux=True)) must be a dict of scalars, "
            "got "
            f"{type(metrics).__name__}."
        )
    check_metric_names(metrics, "loss_fn's aux metrics")
    return metrics


def check_metric_names(names: Any, what: str) -> None:
    """Refuses names the step writes itself (:data:`STEP_METRICS`): the step's value would
    silently replace the user's."""
    clash = [k for k in names if k in STEP_METRICS]
    if clash:
        meaning = "; ".join(f"{k!r} is {STEP_METRICS[k]}" for k in clash)
        raise ValueError(
            f"{what} use {clash}, a name the step writes itself ({meaning}), so the step's value "
            f"would replace yours. Rename it (e.g. 'my_{clash[0]}'). The step's own metrics are "
            f"{sorted(STEP_METRICS)}."
        )


def _ratio(num: Any, den: Any) -> Any:
    """``num / den``, and 0 where ``den`` is 0 (a window without real examples)."""
    nonzero = den > 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


def mean_metrics(
    mean: Extras, micro_per_call: int, window_count: Any, *, summed: tuple[str, ...] = (),
    num_devices: int = 1,
) -> dict:
    """The step's reported metrics from the averaged extras (means over real examples; those
    named in ``summed``: sums over devices and micro-batches).

    Args:
      window_count: micro-batches in the window (the denominator without ``weighted``).
    """
    # A sum is the all-reduced mean times the device count (exact for power-of-two counts).
    out = {k: v * num_devices if k in summed else v / micro_per_call
           for k, v in mean.metrics.items()}
    if mean.window_weight is None:
        window = mean.window_loss / window_count
    else:
        for k, v in mean.sums.items():
            out[k] = _ratio(v, mean.weight)
        window = _ratio(mean.window_loss, mean.window_weight)
    if "loss" in out:  # this call's, next to the window's
        out["window_loss"] = window
    else:
        out["loss"] = window
    return out


@dataclasses.dataclass(frozen=True)
class Loss:
    """What ``loss_fn`` takes and returns, and how its outputs combine across replicas.

    Attributes:
      has_aux: ``loss_fn`` returns ``(loss, metrics)``, ``metrics`` a dict of float scalars
        (averaged over devices unless named in ``sum_metrics``).
      weighted: ``loss_fn`` returns unreduced losses (per example or per token) and ``step``
        takes a ``mask`` (or weights) of their shape; the step averages over real entries
        only, across devices and accumulated calls. A step with no real entry is skipped.
      rng: ``loss_fn`` takes a last argument ``rng``, one PRNG key per example of its shard,
        derived from the run's key (``step(state, batch, rng=key)``), the step and the
        example's position in the global batch (``jddp.random``).
      sum_metrics: aux metrics summed over devices and micro-batches instead of averaged
        (counts, token totals); needs ``has_aux``.
      model_state_sync: how the new model state (``init(params, model_state)``) is made the
        same on every replica: ``"broadcast"`` (replica 0's, DDP's ``broadcast_buffers``),
        ``"mean"`` (averaged; integer leaves broadcast) or ``"none"`` (one per replica).
    """

    has_aux: bool = False
    weighted: bool = False
    rng: bool = False
    sum_metrics: tuple[str, ...] = ()
    model_state_sync: options.ModelStateSync = "broadcast"

    def __post_init__(self) -> None:
        for name in ("has_aux", "weighted"):
            object.__setattr__(self, name, options.flag(getattr(self, name), f"Loss.{name}"))
        object.__setattr__(self, "rng", options.flag(self.rng, "Loss.rng",
                                       " Pass the key itself to step(state, batch, rng=key)."))
        summed = options.metric_names(self.sum_metrics, "Loss.sum_metrics")
        check_metric_names(summed, "Loss.sum_metrics")
        if summed and not self.has_aux:
            raise ValueError(
                f"jddp.Loss: sum_metrics={summed} names aux metrics, but has_aux=False: return "
                "(loss, metrics) from loss_fn and pass jddp.Loss(has_aux=True, sum_metrics=...)."
            )
        object.__setattr__(self, "sum_metrics", summed)
        object.__setattr__(self, "model_state_sync", options.model_state_sync(self.model_state_sync))

    @property
    def per_replica_state(self) -> bool:
        """Each replica keeps its own model state (``model_state_sync="none"``)."""
        return self.model_state_sync == "none"

    def model_state_layout(self, model_state: Any, num_devices: int) -> Any:
        """The initial model state as the step keeps it: one copy per device (a leading
        device dimension) with ``model_state_sync="none"``, else the one synchronised copy."""
        if self.per_replica_state:
            return broadcast_to_devices(model_state, num_devices)
        return model_state

    def model_state_spec(self, per_device: Any, synced: Any) -> Any:
        """The partition spec of the model state's leaves: ``per_device`` with
        ``model_state_sync="none"``, else ``synced``."""
        return per_device if self.per_replica_state else synced

    def key_like(self, rng: Any) -> Any:
        """``rng``, or with ``rng=True`` and none given a placeholder key (for tracing only:
        shapes matter)."""
        return jax.random.key(0) if self.rng and rng is None else rng

    def objective(self, loss_fn: Callable[..., Any], stateful: bool) -> Objective:
        """``loss_fn`` as the step differentiates it (``stateful``: it takes model state)."""
        return Objective(loss_fn, stateful, self)

    def check_call(self, mask: Any, size: int, rng: Any) -> Any:
        """Trace-time checks of a call's ``mask`` and ``rng`` against this policy; returns the
        mask as float32 weights of the global batch's ``size`` examples (``None`` unweighted)."""
        if self.rng and rng is None:
            raise ValueError(
                "This DataParallel was built with loss=jddp.Loss(rng=True), so loss_fn takes "
                "per-example keys: pass the run's key to every step, ddp.step(state, batch, "
                "rng=key) (the step and each example's position are folded into it)."
            )
        if rng is not None:
            if not self.rng:
                raise ValueError(
                    "step got rng=..., but loss_fn does not take keys: build the DataParallel "
                    "with loss=jddp.Loss(rng=True) and give loss_fn a last argument rng (one key "
                    "per example)."
                )
            rng_lib.check_key(rng)
        if not self.weighted:
            if mask is not None:
                raise ValueError(
                    "step got a mask, but this DataParallel averages per-shard mean losses. "
                    "Construct it with loss=jddp.Loss(weighted=True) and make loss_fn return "
                    "per-example losses."
                )
            return None
        if mask is None:
            return jnp.ones((size,), jnp.float32)
        return check_mask(mask, size)

    def example_keys(self, rng: Any, step: Any, local: int,
                     where: Callable[[], tuple[Any, Any]]) -> Any:
        """This device's ``local`` per-example keys (see :mod:`jddp._src.data.rng`), or ``None`` when
        ``loss_fn`` takes none; ``where()`` gives the device's first row in the global batch and
        the call's index in its window (traced only when keys are made)."""
        if not self.rng:
            return None
        start, call = where()
        return rng_lib.example_keys(rng, step, local, start=start, call=call)

    def report(self, mean: Extras, micro_per_call: int, window_count: Any,
               num_devices: int) -> dict:
        """The step's metrics from the averaged extras (:func:`mean_metrics`, with this
        policy's summed metrics)."""
        return mean_metrics(mean, micro_per_call, window_count, summed=self.sum_metrics,
                            num_devices=num_devices)
