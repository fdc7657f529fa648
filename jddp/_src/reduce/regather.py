"""Stage 3's ``reshard_after_forward``: an equation that reads gathered parameters keeps only
their pieces for its backward, which gathers them again (prefetched one use ahead where
collectives are asynchronous): :func:`regathered`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jddp._src.core.collectives import traced_platform
from jddp._src.introspect import jaxpr as jaxpr_lib
from jddp._src.introspect import vma
from jddp._src.reduce.sharded import GatherInForward
from jddp._src.tree import chain_dependency


def backward_prefetch() -> bool:
    """Whether stage 3's backward gathers (``reshard_after_forward``) are prefetched one use
    ahead (see :func:`regathered`): where collectives are asynchronous (GPU, TPU), not on CPU,
    where a collective cannot overlap anything and a prefetch would only hold gathered leaves
    longer (on the 8-layer test MLP the compiled CPU peak rose from 2.41 to 3.46 MB)."""
    return traced_platform() != "cpu"


def _token_cotangent(dep: Any, token: Any) -> Any:
    """``dep`` (an always-zero scalar) as the cotangent of ``token``: typed and varying like it;
    ``None`` (no prefetch through this link) when ``dep`` varies over axes ``token`` does not."""
    axes = vma.varying_axes(token)
    if token is None or dep is None or not vma.varying_axes(dep) <= axes:
        return None
    return vma.to_varying(dep.astype(token.dtype), tuple(sorted(axes)))


def regathered(eqn: Any, invals: list, sources: tuple, leaves: dict[int, Any],
                pieces: dict[int, jax.Array], reducer: GatherInForward,
                token: Any) -> tuple[list, Any]:
    """Evaluates ``eqn`` on its gathered parameter inputs, keeping only their pieces (hpZ: see
    :meth:`GatherInForward.keep`) for the backward, which gathers them again; returns its
    outputs and the token for the next such equation.

    A custom VJP whose residuals are the equation's other inputs and the pieces; its backward
    gathers only the leaves the equation's VJP needs and recomputes that VJP. With a ``token``
    (GPU, TPU: :func:`backward_prefetch`) the gather is prefetched one use ahead (FSDP's
    ``BACKWARD_PRE``), else it waits for this equation's own output cotangent; either way it
    waits for the backward, so XLA's CSE cannot merge it with the forward's (docs/sharded.md).
    A :class:`jddp._src.introspect.jaxpr.Derived` input is recomputed from the gathered leaves.

    Args:
      sources: per input of ``eqn``, the parameter leaf it reads, the value computed from
        leaves alone that it reads, or ``None`` (its value in ``invals``).
      pieces: per gathered leaf index, this device's piece (the step's input).
      token: the previous such equation's token output, or the first token (a zero scalar);
        ``None``: no prefetch.
    """
    idx, whole, other_pos = _regathered_inputs(invals, sources, leaves, pieces)
    perturbed: list[bool] = []

    def run(others: tuple, full: tuple) -> list:
        vals = list(invals)
        for j, x in zip(other_pos, others, strict=True):
            vals[j] = x
        values = dict(zip(whole, others[len(other_pos):], strict=True))
        values.update(zip(idx, full, strict=True))
        return jaxpr_lib.bind_eqn(eqn, jaxpr_lib.fill(vals, sources, values))

    @jax.custom_vjp
    def op(others: tuple, full: tuple, pcs: tuple, tok: Any) -> tuple[list, Any]:
        del pcs
        return run(others, full), tok

    def fwd(others: tuple, full: tuple, pcs: tuple, tok: Any) -> tuple:
        perturbed[:] = [o.perturbed for o in others] + [tok is not None and tok.perturbed]
        values, fulls = tuple(o.value for o in others), tuple(f.value for f in full)
        tok = None if tok is None else tok.value
        out, kept = reducer.keep(idx, run(values, fulls), [p.value for p in pcs], fulls)
        return (out, tok), (values, kept, tok)

    def bwd(res: tuple, cts: tuple) -> tuple:
        others, pcs, tok = res
        out_cts, ahead = cts
        out_cts = [jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c
                   for c in out_cts]
        floats = [c for c in out_cts if jnp.issubdtype(jnp.result_type(c), jnp.inexact)]
        own = chain_dependency(floats, "add") if floats else None
        ahead = own if ahead is None or isinstance(ahead, SymbolicZero) else ahead
        d_others, d_full, gathered, after = _regathered_vjp(
            run, others, out_cts, [k for k, p in enumerate(perturbed[:-1]) if p],
            idx, pcs, reducer, ahead, tok is not None)
        passed = _passed_on(ahead, own, after, gathered)
        return (d_others, d_full, tuple(None for _ in pcs),
                _token_cotangent(passed, tok) if perturbed[-1] else None)

    op.defvjp(fwd, bwd, symbolic_zeros=True)
    outs, token_out = op((*(invals[j] for j in other_pos), *(leaves[i] for i in whole)),
                         tuple(leaves[i] for i in idx), tuple(pieces[i] for i in idx), token)
    return outs, token_out


def _regathered_inputs(invals: list, sources: tuple, leaves: dict[int, Any],
                       pieces: dict[int, jax.Array]) -> tuple[tuple, tuple, list[int]]:
    """The gathered leaves read, the leaves read whole (not gathered, read as they come) and
    the positions of the equation's other (non-parameter) array inputs."""
    idx = tuple(i for i in leaves if i in pieces)
    whole = tuple(i for i in leaves if i not in pieces)
    other_pos = [j for j, (x, s) in enumerate(zip(invals, sources, strict=True))
                 if s is None and isinstance(x, jax.Array | jax.core.Tracer)]
    return idx, whole, other_pos


def _passed_on(ahead: Any, own: Any, after: Any, gathered: Any) -> Any:
    """What the previous equation's gather waits for: this one's backward start and its gather
    (so that XLA's combiner cannot merge the two); else what this one got."""
    if not gathered:
        return ahead
    return own if after is None else (after if own is None else own + after)


def _regathered_vjp(run: Callable[[tuple, tuple], list], others: tuple, cts: list,
                    diff: list[int], idx: tuple, pcs: tuple, reducer: GatherInForward,
                    wait: Any, prefetch: bool) -> tuple[tuple, tuple, list[int], Any]:
    """The backward of :func:`regathered`: gathers the leaves ``idx`` its VJP reads (once
    ``wait`` is there) and differentiates ``run`` at them; ``(d_others, d_full, gathered,
    after)``, ``after`` (with ``prefetch``) an always-zero scalar that depends on the gathered
    leaves, else ``None``."""

    def grads(full: tuple) -> tuple:
        def f(d_others: tuple, full: tuple) -> list:
            vals = list(others)
            for k, x in zip(diff, d_others, strict=True):
                vals[k] = x
            return run(tuple(vals), full)
        _, vjp = jax.vjp(f, tuple(others[k] for k in diff), full)
        return vjp(list(cts))

    # The leaves as the equation reads them: in a mixed-precision policy's dtype if any.
    structs = tuple(jax.ShapeDtypeStruct(zero_shape, dtype) for zero_shape, dtype in
                    ((reducer.inner.plan.shapes[i], reducer.inner.plan.dtypes[i]
                      if reducer.dtype is None else reducer.dtype) for i in idx))
    needed = jaxpr_lib.used_inputs(jax.make_jaxpr(grads)(structs))
    need = [k for k in range(len(idx)) if needed[k]]
    if need and wait is not None:
        dep = lax.stop_gradient(wait)
        pcs = tuple(p + dep.astype(p.dtype) for p in pcs)
    # Under its bucket's name, as the forward's gather: the report and profiles file it there.
    # (Leaves of several buckets read by one equation are gathered in one collective: the first
    # bucket's name.)
    from jddp._src.introspect import hlo  # the name's one definition; loaded at trace time

    buckets = [b for b, bucket in enumerate(reducer.inner.plan.buckets)
               if any(idx[k] in bucket.indices for k in need)]
    with jax.named_scope(hlo.bucket_scope(buckets[0])) if buckets else contextlib.nullcontext():
        got = reducer.regather([idx[k] for k in need], [pcs[k] for k in need])
    full = [jnp.zeros(s.shape, s.dtype) for s in structs]
    for k, x in zip(need, got, strict=True):
        full[k] = x
    d_diff, d_full = grads(tuple(full))
    after = None
    if got and prefetch:
        # The leaves' gradients (hence their bucket's reduction and the optimizer's update of
        # their pieces) wait for the gather: else XLA:GPU fuses the update and the add above
        # into one multi-output fusion, and the gather waits for the bucket's reduction.
        after = lax.stop_gradient(chain_dependency(got, "add"))
        d_full = tuple(d + after.astype(d.dtype) for d in d_full)
    d_others: list[Any] = [None] * len(others)
    for k, d in zip(diff, d_diff, strict=True):
        d_others[k] = d
    return tuple(d_others), tuple(d_full), [idx[k] for k in need], after
