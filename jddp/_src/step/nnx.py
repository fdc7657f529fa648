"""Flax NNX support: data-parallel training of an ``nnx.Module``.

The bridge is NNX's functional API (``nnx.split``/``nnx.merge``): :class:`DataParallel` trains a
``loss_fn(model, batch)`` and carries non-``Param`` state in ``TrainState.model_state``;
:func:`wrap` turns a model and its loss into a pure ``loss(params, batch)`` (docs/flax.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from jddp._src.api.policies import Loss
from jddp._src.plan.planner import BucketPlan
from jddp._src.plan.report import Report
from jddp._src.step.objective import check_loss_arity, unpack_loss_output
from jddp._src.step.state import TrainState
from jddp._src.step.step import Step
from jddp._src.step.trainer import DataParallel as CoreDataParallel

# The round-3 keywords that are fields of jddp.Loss (see jddp._src.api.deprecated).
_ROUND3_LOSS_KEYWORDS = frozenset({"weighted", "rng", "sum_metrics", "model_state_sync"})


def _split(model: nnx.Module, wrt: Any) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``(graphdef, wrt_state, rest)``: ``nnx.split`` with exactly two filters."""
    graphdef, params, rest = nnx.split(model, wrt, ...)  # type: ignore[misc]
    return graphdef, params, rest


def wrap(
    model: nnx.Module,
    loss_fn: Callable[..., Any],
    *,
    wrt: Any = nnx.Param,
) -> tuple[Callable[..., Any], nnx.State, nnx.State]:
    """A pure loss over the ``wrt`` state of an NNX model, for the functional jddp API.

    Example::

        mse = lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean()
        loss, params, _ = jddp.nnx.wrap(model, mse)
        ddp = jddp.DataParallel(loss, optax.adam(1e-3))
        state = ddp.init(params)
        ...
        nnx.update(model, state.params)    # write the trained parameters back into the model

    Args:
      model: the NNX module.
      loss_fn: ``loss_fn(model, *args)`` returning the loss (or ``(loss, aux)``); the returned
        function passes its extra arguments through, so ``has_aux`` is up to the caller.
      wrt: the NNX filter of the differentiated state (default ``nnx.Param``).

    Returns:
      ``(loss_over_params, params, rest)``: ``loss_over_params(params, *args)`` merges the model
      from ``params`` and the ``rest`` state captured now, and calls ``loss_fn``. Changes that the
      forward pass makes to the non-``wrt`` state are discarded; use :class:`DataParallel` for
      models with BatchNorm statistics or dropout RNG streams.
    """
    graphdef, params, rest = _split(model, wrt)

    def loss_over_params(params: nnx.State, *args: Any) -> Any:
        return loss_fn(nnx.merge(graphdef, params, rest), *args)

    return loss_over_params, params, rest


def _check_same_shapes(model: nnx.Module, params: Any, rest: Any, graphdef: Any, wrt: Any) -> None:
    """``model`` must have the structure, shapes and dtypes of the state written into it."""
    model_graphdef, model_params, model_rest = _split(model, wrt)
    if model_graphdef != graphdef:
        raise ValueError(
            "update(model, state): model does not have the structure of the model this "
            "DataParallel was built with (other layers, sizes or options). Pass a model built "
            "like that one, or ddp.merge(state) for a new model with the trained values."
        )
    for name, mine, theirs in (("parameter", model_params, params), ("model state", model_rest,
                                                                     rest)):
        want = jax.tree_util.tree_flatten_with_path(mine)[0]
        got = jax.tree.leaves(theirs)
        for (path, a), b in zip(want, got, strict=False):
            if jax.numpy.shape(a) != jax.numpy.shape(b):
                where = jax.tree_util.keystr(path).removesuffix(".value")  # the Variable's
                raise ValueError(
                    f"update(model, state): {name} {where} of the model has "
                    f"shape {jax.numpy.shape(a)}, the state's has {jax.numpy.shape(b)}. Pass a "
                    "model built like the one this DataParallel was built with, or "
                    "ddp.merge(state) for a new model with the trained values."
                )


@dataclasses.dataclass(frozen=True)
class _ModelLoss:
    """The core trainer's ``loss_fn(params, model_state, batch[, rng])`` for an NNX
    ``loss_fn(model, batch[, rng])``: merges the model, calls the loss, splits the updated rest
    back out."""

    graphdef: Any
    wrt: Any
    loss_fn: Callable[..., Any]
    has_aux: bool

    def __call__(self, params: nnx.State, rest: nnx.State, batch: Any, *rng: Any) -> Any:
        # copy=True: fresh Variables in the current trace. The states may come from an outer trace
        # (jax.grad passes non-differentiated arguments through as they are, as the accumulating
        # step does), where NNX refuses the forward pass's writes, and must not be mutated anyway.
        model = nnx.merge(self.graphdef, params, rest, copy=True)
        out = unpack_loss_output(self.loss_fn(model, batch, *rng), has_aux=self.has_aux,
                                 stateful=False)
        _, _, new_rest = _split(model, self.wrt)
        return (out.loss, (new_rest, out.metrics)) if self.has_aux else (out.loss, new_rest)


class DataParallel:
    """Data-parallel training of an NNX model: ``loss_fn(model, batch)`` with an optax optimizer.

    A front end over :class:`jddp.DataParallel`: the model is split into its ``graphdef``, the
    ``wrt`` state (``nnx.Param`` by default; differentiated, reduced and optimised) and the rest
    (BatchNorm statistics, RNG keys and counts; carried as ``TrainState.model_state``). The core
    trainer's loss merges the model from the two states, calls ``loss_fn(model, batch)`` and splits
    the updated rest back out, so every policy of :class:`jddp.DataParallel` applies. A step on N
    devices equals a single-device ``nnx.Optimizer`` step on the whole batch for models whose
    forward pass is per-example (no BatchNorm in training mode).

    The rest is synchronised as ``jddp.Loss(model_state_sync=...)`` says (default
    ``"broadcast"``: replica 0's state, DDP's ``broadcast_buffers``; ``"mean"`` averages the
    floating-point leaves). Dropout masks drawn from the module's own ``nnx.Rngs`` therefore
    repeat across devices, as in a DDP job whose ranks share one seed. For per-example masks pass
    ``loss=jddp.Loss(rng=True)`` and take ``loss_fn(model, batch, rng)`` with one key per example
    (the key of its global row, so a step on N devices equals the single-device step)::

        def loss_fn(model, batch, rng):
            one = lambda x, key: model(x[None], rngs=nnx.Rngs(dropout=key))[0]
            return ((jax.vmap(one)(batch["x"], rng) - batch["y"]) ** 2).mean()

        ddp = jddp.nnx.DataParallel(model, optax.adam(1e-3), loss_fn=loss_fn,
                                    loss=jddp.Loss(rng=True))
        state = ddp.init()
        state, metrics = ddp.step(state, batch, rng=jax.random.key(0))

    With ``sync=jddp.local_sgd.diloco(...)`` (or ``post_local_sgd``) each replica trains its
    own copy; :meth:`merge` and :meth:`update` write the global parameters (DiLoCo's outer
    parameters, or the replicas' mean) and replica 0's model state.

    Example::

        model = MLP(rngs=nnx.Rngs(0))
        ddp = jddp.nnx.DataParallel(model, optax.adam(1e-3),
                                    loss_fn=lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean())
        state = ddp.init()
        for batch in batches:
            state, metrics = ddp.step(state, batch)
        ddp.update(model, state)          # or: trained = ddp.merge(state)

    Args:
      model: the NNX module; only its structure (``graphdef``) is kept, its values are read by
        :meth:`init`.
      optimizer: an optax ``GradientTransformation`` over the ``wrt`` state.
      loss_fn: ``loss_fn(model, batch) -> loss``, the mean loss over the batch shard; with
        ``has_aux``, ``(loss, metrics)`` with a dict of float scalar metrics; with
        ``jddp.Loss(weighted=True)``, the per-example losses of the shard; with
        ``jddp.Loss(rng=True)``, ``loss_fn(model, batch, rng)`` with one PRNG key per example of
        the shard.
      wrt: the NNX filter of the trained state (default ``nnx.Param``).
      has_aux: whether ``loss_fn`` returns ``(loss, metrics)`` (or say it in
        ``loss=jddp.Loss(has_aux=True, ...)``).
      **options: every other keyword argument of :class:`jddp.DataParallel` (``mesh``,
        ``loss``, ``reduce``, ``place``, ``accumulate``, ``sync``, ...), with its defaults.
        With ``jddp.Loss(model_state_sync="none")``, :meth:`merge` and :meth:`update` use
        replica 0's state.

    Attributes:
      step: the core trainer's step, ``step(state, batch, mask=None, *, sync=None) -> (state,
        metrics)``; ``batch`` has the global batch as leading dimension, ``metrics["loss"]`` is the
        loss averaged over devices. It consumes its input state.
      graphdef: the model's static structure (``nnx.graphdef(model)``).
      core: the :class:`jddp.DataParallel` that runs the step.

    Every public name of :class:`jddp.DataParallel` is here with the same meaning (``report``,
    ``plan``, ``verify``, ``global_params``, ``lower``, ``abstract_state``, ``mesh``,
    ``optimizer``, ``policies``, ``config``, ``bucket_plan``, ``cap_choice``, ...); where
    DataParallel takes a parameter pytree, this takes the NNX forms: a model, its ``wrt`` state
    (with ``model_state=`` for the rest), or a TrainState.
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable[..., Any],
        *,
        wrt: Any = nnx.Param,
        has_aux: bool = False,
        **options: Any,
    ) -> None:
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"model must be a flax.nnx.Module, got {type(model).__name__}. For Linen or plain "
                "pytrees of parameters use jddp.DataParallel."
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        graphdef = nnx.graphdef(model)
        # has_aux here is nnx's own keyword (its loss wrapper needs it); with loss=jddp.Loss(...)
        # the policy says it, and the core sees the wrapper's (loss, (state, metrics)) form.
        policy = options.get("loss")
        aux = bool(has_aux) or bool(getattr(policy, "has_aux", False))
        if policy is None and not _ROUND3_LOSS_KEYWORDS & options.keys():
            options["loss"] = Loss(has_aux=has_aux)
        elif policy is None and has_aux:  # next to round-3 keywords of the loss: one more
            options["has_aux"] = True
        elif has_aux:
            raise ValueError("has_aux=True and loss=jddp.Loss(...) were both given: pass "
                             "loss=jddp.Loss(has_aux=True, ...) alone.")
        core = CoreDataParallel(_ModelLoss(graphdef, wrt, loss_fn, aux), optimizer, **options)
        rng = core.config.loss.rng
        check_loss_arity(loss_fn, 2 + rng, stateful=False, rng=rng, first="model")
        for name, value in (("graphdef", graphdef), ("wrt", wrt), ("_model", model),
                            ("core", core), ("step", core.step)):
            object.__setattr__(self, name, value)

    graphdef: Any
    wrt: Any
    core: CoreDataParallel
    step: Step
    _model: nnx.Module

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"jddp.nnx.DataParallel options are fixed at construction (the step is compiled from "
            f"them): cannot set {name!r}. Build a new one with the option you want."
        )

    def __getattr__(self, name: str) -> Any:
        """The core trainer's other public names (``config``, ``verify``, ``global_params``...)."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.core, name)

    @property
    def loss_fn(self) -> Callable[..., Any]:
        return self.core.loss_fn.loss_fn

    def split(self, model: nnx.Module | None = None) -> tuple[nnx.State, nnx.State]:
        """``(params, rest)`` of ``model`` (default: the model given at construction)."""
        model = self._model if model is None else model
        graphdef, params, rest = _split(model, self.wrt)
        if graphdef != self.graphdef:
            raise ValueError("model does not have the structure of the model this was built with.")
        return params, rest

    def init(self, model: nnx.Module | None = None) -> TrainState:
        """The replicated initial state from ``model``'s current values (default: the model given
        at construction): ``params`` is its ``wrt`` state, ``model_state`` the rest."""
        params, rest = self.split(model)
        return self.core.init(params, model_state=rest)

    def _model_state(self, state: TrainState) -> Any:
        if self.model_state_sync == "none" or self.core.config.topology.islands:
            # One copy per device or per replica: take replica 0's.
            return jax.tree.map(lambda x: x[0], state.model_state)
        return state.model_state

    def merge(self, state: TrainState) -> nnx.Module:
        """A new model with the parameters and model state of ``state`` (with local SGD the
        global parameters, :meth:`jddp.DataParallel.global_params`)."""
        return nnx.merge(self.graphdef, self.core.global_params(state), self._model_state(state))

    def update(self, model: nnx.Module, state: TrainState) -> None:
        """Writes the parameters and model state of ``state`` into ``model`` in place (with local
        SGD the global parameters).

        Raises:
          ValueError: ``model`` has another structure or other shapes than the model this was
            built with (``nnx.update`` alone would write the state's arrays into it silently).
        """
        params, rest = self.core.global_params(state), self._model_state(state)
        _check_same_shapes(model, params, rest, self.graphdef, self.wrt)
        nnx.update(model, params, rest)

    def _states(self, like: Any, model_state: Any = None) -> tuple[Any, Any]:
        """``(params, rest)`` from what a user holds: ``None`` (the model given at construction),
        an ``nnx.Module``, a :class:`jddp.TrainState` (or :meth:`abstract_state`), or the ``wrt``
        state itself (arrays or ``jax.ShapeDtypeStruct``s; ``model_state`` then gives the rest,
        by default the construction model's)."""
        if like is None or isinstance(like, nnx.Module):
            params, rest = self.split(like)
        elif isinstance(like, TrainState):
            params, rest = like.params, like.model_state
        else:
            params, rest = like, None
        if model_state is not None:
            rest = model_state
        elif rest is None:
            rest = self.split()[1]
        return params, rest

    def abstract_state(self, model: Any = None, model_state: Any = None) -> TrainState:
        """The TrainState :meth:`init` would build, as shape structs with shardings.

        Args:
          model: an ``nnx.Module`` (default: the model given at construction), or its ``wrt``
            state (arrays or ``jax.ShapeDtypeStruct``s).
          model_state: the rest of the model's state, with ``model`` given as its ``wrt`` state
            (default: the construction model's).
        """
        params, rest = self._states(model, model_state)
        return self.core.abstract_state(params, rest)

    def _step_state(self, state: Any) -> Any:
        """A TrainState as it is; a model or its ``wrt`` state as :meth:`abstract_state`."""
        return state if isinstance(state, TrainState) else self.abstract_state(state)

    def lower(self, state: Any, batch: Any, mask: Any = None, *, sync: bool | None = None,
              step: int | None = None, rng: Any = None) -> jax.stages.Lowered:
        """Lowers the step for ``state`` (a TrainState or :meth:`abstract_state`; or a model or
        its ``wrt`` state, taken as their abstract state) and ``batch`` (arrays or
        ``jax.ShapeDtypeStruct``s): ``self.step.lower``. ``.compile().as_text()`` is the compiled
        HLO."""
        return self.step.lower(self._step_state(state), batch, mask, sync=sync, step=step,
                               rng=rng)

    def plan(self, model: Any, batch: Any = None, model_state: Any = None,
             mask: Any = None) -> BucketPlan:
        """The bucket plan the step uses for a global ``batch``, before any step
        (:meth:`jddp.DataParallel.plan`).

        Args:
          model: an ``nnx.Module``, a TrainState, or the ``wrt`` state (arrays or
            ``jax.ShapeDtypeStruct``s; ``None``: the model given at construction).
            ``ddp.plan(batch)`` alone plans for the model given at construction.
          batch: the global batch (arrays or ``jax.ShapeDtypeStruct``s).
          model_state: the rest of the model's state, with ``model`` given as its ``wrt`` state.
          mask: the step's mask, if it takes one.
        """
        if batch is None:  # plan(batch)
            model, batch = None, model
        params, rest = self._states(model, model_state)
        return self.core.plan(params, batch, rest, mask)

    def report(self, state: Any, batch: Any, mask: Any = None, *, sync: bool | None = None,
               rng: Any = None) -> Report:
        """The compiled step's collectives and memory (:meth:`jddp.DataParallel.report`; see
        docs/report.md). ``state``: a TrainState, :meth:`abstract_state`, or a model (or its
        ``wrt`` state), taken as its abstract state."""
        return self.core.report(self._step_state(state), batch, mask, sync=sync, rng=rng)
