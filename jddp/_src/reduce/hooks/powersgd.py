"""DDP's ``powerSGD_hook``: rank-r factors of matrix gradients with error feedback and warm
start (Vogels et al.): :func:`powersgd`."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jddp._src.api import options
from jddp._src.core import recorder
from jddp._src.introspect import vma
from jddp._src.reduce.hooks import CommHook, HookContext, leaf_str


def _matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    # DDP views an N-D gradient as (shape[0], prod(shape[1:])). Flax kernels are (in, ..., out), so
    # the same rule applies: which side is rows does not change the factor sizes much.
    return int(shape[0]), int(math.prod(shape[1:]))


def _compressed_rank(shape: Sequence[int], rank: int, min_rate: float) -> int:
    """The rank PowerSGD uses for a leaf of ``shape``, or 0 to all-reduce it uncompressed."""
    if len(shape) < 2:
        return 0
    n, m = _matrix_shape(shape)
    r = min(rank, n, m)
    # DDP's _should_compress: compress only if the factors are min_rate times smaller.
    return r if (n + m) * r * min_rate < n * m else 0


def _orthogonalize(p: jax.Array, eps: float = 1e-8) -> jax.Array:
    """Gram-Schmidt on the (few) columns of ``p``; identical inputs give identical outputs."""
    cols: list[jax.Array] = []
    for j in range(p.shape[1]):
        c = p[:, j]
        for q in cols:
            c = c - jnp.dot(q, c) * q
        cols.append(c / (jnp.linalg.norm(c) + eps))
    return jnp.stack(cols, axis=1)


def _q_init(n: int, m: int, r: int, seed: int, step: Any = None) -> jax.Array:
    # The same on every replica (P = M Q is summed over them): a key from the seed and the shape.
    salt = zlib.crc32(repr((n, m, r)).encode()) & 0x7FFFFFFF
    key = jax.random.fold_in(jax.random.PRNGKey(seed), salt)
    if step is not None:
        key = jax.random.fold_in(key, step)
    return _orthogonalize(jax.random.normal(key, (m, r), jnp.float32))


def _describe(state: Any) -> str:
    """A hook state's structure with each leaf's dtype and shape, for messages."""
    shown = jax.tree.map(leaf_str, state)
    return repr(shown) if jax.tree.leaves(state) else repr(state)


@dataclasses.dataclass(frozen=True, eq=False)
class _PowerSGD:
    """The functions of a :func:`powersgd` hook, over its validated options (see there)."""

    rank: int
    start_iter: int
    min_compression_rate: float
    error_feedback: bool
    warm_start: bool
    seed: int

    def ranks(self, leaves: Sequence[Any]) -> list[int]:
        return [
            _compressed_rank(jnp.shape(x), self.rank, self.min_compression_rate) for x in leaves
        ]

    def init(self, leaf: jax.ShapeDtypeStruct):
        r = _compressed_rank(leaf.shape, self.rank, self.min_compression_rate)
        if not r:
            return ()
        n, m = _matrix_shape(leaf.shape)
        state = {}
        if self.warm_start:
            state["q"] = _q_init(n, m, r, self.seed)
        if self.error_feedback:
            state["residual"] = jnp.zeros(leaf.shape, jnp.float32)
        return state

    def plain(self, grads, states, ctx: HookContext):
        summed = recorder.psum(tuple(grads), ctx.axis_name)
        return tuple(s / ctx.axis_size for s in summed), tuple(states)

    def compressed(self, grads, states, ctx: HookContext):
        rs = self.ranks(grads)
        n_dev = ctx.axis_size
        mats, qs = {}, {}
        for i, (g, r) in enumerate(zip(grads, rs, strict=True)):
            if not r:
                continue
            m = g.astype(jnp.float32)
            if self.error_feedback:
                m = m + states[i]["residual"]
            rows, cols = _matrix_shape(g.shape)
            mats[i] = m.reshape(rows, cols)
            qs[i] = states[i]["q"] if self.warm_start else _q_init(rows, cols, r, self.seed, ctx.step)
        # One all-reduce for the uncompressed leaves and every P; one more for every Q.
        plain_idx = [i for i, r in enumerate(rs) if not r]
        ps = {i: mats[i] @ qs[i] for i in mats}
        summed = recorder.psum((tuple(grads[i] for i in plain_idx), tuple(ps.values())), ctx.axis_name)
        out: list[Any] = [None] * len(grads)
        for i, s in zip(plain_idx, summed[0], strict=True):
            out[i] = s / n_dev
        ps = {i: _orthogonalize(p) for i, p in zip(ps, summed[1], strict=True)}
        q_sum = recorder.psum(tuple(mats[i].T @ ps[i] for i in ps), ctx.axis_name)
        new_states = list(states)
        for i, q in zip(ps, q_sum, strict=True):
            q = q / n_dev
            approx = ps[i] @ q.T
            out[i] = approx.reshape(grads[i].shape).astype(grads[i].dtype)
            new_states[i] = self._new_state(q, mats[i] - approx, grads[i], states[i], ctx)
        return tuple(out), tuple(new_states)

    def _new_state(self, q, residual, grad, state, ctx: HookContext) -> dict:
        """One compressed leaf's next state: its ``Q`` (warm start) and residual (error
        feedback), each varying over the axis like the state it replaces."""
        st = {}
        if self.warm_start:
            st["q"] = vma.like(q, state["q"], ctx.axis_name)
        if self.error_feedback:
            st["residual"] = vma.like(
                residual.reshape(grad.shape), state["residual"], ctx.axis_name
            )
        return st

    def check_states(self, grads, states) -> None:
        """Raises a clear error for states this hook did not make (e.g. a TrainState built by a
        trainer without the hook, whose per-leaf states are ``()``), before indexing them."""
        for g, st in zip(grads, states, strict=True):
            want = jax.eval_shape(lambda g=g: self.init(jax.ShapeDtypeStruct(g.shape, g.dtype)))
            # jaxlib types PyTreeDef loosely for mypy; the comparison is real.
            same = jax.tree.structure(st) == jax.tree.structure(want)  # type: ignore[operator]
            if same and all(jnp.shape(x) == w.shape and jnp.result_type(x) == w.dtype
                            for x, w in zip(jax.tree.leaves(st), jax.tree.leaves(want),
                                            strict=True)):
                continue
            expected = jax.tree.map(lambda w: f"{w.dtype}{list(w.shape)}", want)
            raise ValueError(
                f"The powersgd hook got a state it did not make for a gradient leaf of shape "
                f"{list(g.shape)}: {_describe(st)}, where it keeps {expected or '()'}. The "
                "TrainState was built by a DataParallel without this hook (or with other "
                "powersgd options: rank, warm_start, error_feedback, min_compression_rate). "
                "Build it with this trainer (state = ddp.init(params)), or restore a checkpoint "
                "through it (jddp.checkpoint.restore_or_init(mngr, ddp, params))."
            )

    def reduce(self, grads, states, ctx: HookContext):
        self.check_states(grads, states)
        if not any(self.ranks(grads)):
            return self.plain(grads, states, ctx)
        # The residual depends on local gradients: make the state vary like them in both branches.
        states = jax.tree.map(lambda s: vma.like(s, grads[0], ctx.axis_name), tuple(states))
        if self.start_iter <= 0 or ctx.phase == "compressed":
            return self.compressed(grads, states, ctx)
        if ctx.phase == "plain":
            return self.plain(grads, states, ctx)
        # No static phase (a caller that does not track the step on the host): switch in the
        # graph. Both branches' collectives are compiled in; only one runs. XLA:CPU was seen to
        # deadlock on collectives inside a conditional with many steps in flight, hence the phase.
        return recorder.cond(
            ctx.step < self.start_iter,
            lambda g, s: self.plain(g, s, ctx),
            lambda g, s: self.compressed(g, s, ctx),
            tuple(grads), tuple(states),
        )

    def phase(self, step: int) -> str:
        return "plain" if step < self.start_iter else "compressed"


def powersgd(
    rank: int = 1,
    start_iter: int = 1000,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
) -> CommHook:
    """DDP's ``powerSGD_hook``: rank-``rank`` approximation of matrix gradients (Vogels et al.).

    Matrix gradients (``(shape[0], prod(shape[1:]))``) whose factors are ``min_compression_rate``
    times smaller are sent as ``P`` and ``Q`` with error feedback and warm start; the rest by a
    plain all-reduce ([Hooks](../hooks.md) has the algorithm). The ``start_iter`` switch is a
    static ``CommHook.phase``: :class:`jddp.DataParallel` compiles one step per phase.

    Args:
      rank: the approximation rank (DDP's ``matrix_approximation_rank``).
      start_iter: steps of plain all-reduce before compression starts (DDP's default 1000); the
        error-feedback residual starts at zero then.
      min_compression_rate: compress a matrix only if ``n m > rate (n + m) rank``.
      error_feedback: carry the per-device residual ``M - approximation`` to the next step (a
        float32 array the size of each compressed gradient, per device).
      warm_start: start each step's power iteration from the previous ``Q`` (otherwise a fresh
        random ``Q`` is drawn each step, identically on every replica).
      seed: seeds the initial ``Q``.

    Returns:
      A stateful :class:`CommHook`; :class:`jddp.DataParallel` carries the state.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}.")
    error_feedback = options.flag(error_feedback, "error_feedback")
    warm_start = options.flag(warm_start, "warm_start")
    if min_compression_rate < 1:
        raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate}.")
    start_iter = int(start_iter)
    impl = _PowerSGD(rank, start_iter, min_compression_rate, error_feedback, warm_start, seed)
    name = f"powersgd(rank={rank}, start_iter={start_iter})"
    return CommHook(impl.init, impl.reduce, name, fuses_extras=True,
                    phase=impl.phase)
