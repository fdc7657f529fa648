"""DiLoCo across islands that fail and rejoin: the outer step through torchft's quorum.

An *island* is one jddp run (``jddp-run --islands N``) running DiLoCo inside; islands meet only at
the outer step, on the host (:meth:`IslandDiLoCo.after_step`), through torchft's Lighthouse
quorum, Gloo process group and healing of a joining island. Deltas are averaged weighted by the
examples each island consumed (one island: in-world DiLoCo exactly); a failed all-reduce is
retried with a new quorum, never skipped or applied twice (docs/islands.md). Torch is imported
only when the first outer step runs.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jddp._src.step.config import SyncContext
from jddp._src.step.state import OuterState
from jddp._src.sync.local_sgd import AVERAGE, DiLoCo

ENV_ISLAND = "JDDP_ISLAND"  # this island's index, 0 .. JDDP_ISLANDS - 1 (set by jddp-run --islands)
ENV_ISLANDS = "JDDP_ISLANDS"  # how many islands the run was started with
ENV_QUORUM = "JDDP_ISLAND_QUORUM"  # "host:port" of torchft's Lighthouse
ENV_STORE = "JDDP_ISLAND_STORE"  # "host:port" of the island's TCPStore (on its process 0)
ENV_ATTEMPT = "JDDP_ISLAND_ATTEMPT"  # 0 on the island's first start, then 1, 2, ... per restart
ENV_GRACE = "JDDP_ISLAND_GRACE"  # seconds the quorum waits for an island (the Lighthouse's)
ENV_QUORUM_TIMEOUT = "JDDP_ISLAND_QUORUM_TIMEOUT"  # bound on one wait for a quorum (seconds)
EXIT_NO_PEER = 76  # a restarted island found no live island to heal from (not restarted)

__all__ = ["IslandDiLoCo", "IslandEnv", "island_diloco", "island_env", "status"]


class IslandEnv(NamedTuple):
    """Where this process's island is, from the variables ``jddp-run --islands`` sets."""

    island: int
    islands: int
    quorum: str
    store: str
    attempt: int
    grace_s: float
    quorum_timeout_s: float


def island_env() -> IslandEnv | None:
    """This process's island (``None``: not started by ``jddp-run --islands``)."""
    if ENV_ISLAND not in os.environ:
        return None
    missing = [k for k in (ENV_QUORUM, ENV_STORE) if not os.environ.get(k)]
    if missing:
        raise RuntimeError(
            f"{ENV_ISLAND} is set but {', '.join(missing)} is not: start islands with "
            "`jddp-run --islands N [--quorum HOST:PORT] script.py`, or set all of "
            f"{ENV_ISLAND}, {ENV_QUORUM} and {ENV_STORE} (docs/islands.md).")
    return IslandEnv(int(os.environ[ENV_ISLAND]), int(os.environ.get(ENV_ISLANDS, "0")),
                     os.environ[ENV_QUORUM], os.environ[ENV_STORE],
                     int(os.environ.get(ENV_ATTEMPT, "0")),
                     float(os.environ.get(ENV_GRACE, "5")),
                     float(os.environ.get(ENV_QUORUM_TIMEOUT, "600")))


def _capture(outer: optax.GradientTransformation) -> optax.GradientTransformation:
    """The outer optimizer as the jitted step sees it: its state is ``(outer's state, the
    island's mean delta)``; it records the delta and moves nothing (the host applies ``outer``
    to the mean over islands)."""

    def init(params: Any) -> tuple[Any, Any]:
        return outer.init(params), jax.tree.map(jnp.zeros_like, params)

    def update(delta: Any, state: tuple[Any, Any], params: Any = None) -> tuple[Any, Any]:
        del params
        return jax.tree.map(jnp.zeros_like, delta), (state[0], delta)

    return optax.GradientTransformation(init, update)


@dataclasses.dataclass(frozen=True)
class IslandDiLoCo(DiLoCo):
    """DiLoCo whose outer step averages the islands in torchft's current quorum.

    ``jddp.local_sgd.diloco(...)`` returns one inside ``jddp-run --islands`` (so a DiLoCo script
    runs unchanged); :func:`island_diloco` builds one explicitly.

    Attributes:
      outer: the outer optimizer (the host applies it; ``outer_optimizer`` is its capture).
      take_part: ``outer step index -> bool`` (``None``: always): ``False`` makes this island sit
        that outer step out (its delta is dropped, it receives the others' step), a scripted
        membership.
    """

    outer: optax.GradientTransformation | None = None
    take_part: Callable[[int], bool] | None = None

    islands: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fragments != 1 or self.compress is not None:
            raise ValueError(
                "jddp-run --islands runs plain DiLoCo across islands: fragments=1 and no "
                "compress hook (torchft carries the outer step in float32).")
        if self.outer is None:
            raise ValueError("IslandDiLoCo needs its outer optimizer: build it with "
                             "jddp.local_sgd.island_diloco(period, ...).")

    def before_step(self, ctx: SyncContext, state: Any, batch: Any, mask: Any) -> Any:
        """On the host before each step: counts the step's examples; on a restarted island's first
        step, joins the next outer step and takes the live global state from a member."""
        rt = _runtime()
        if rt.joined is False and island_env_required().attempt > 0:
            rt.joined = True
            state = self._sync(ctx, state, rt, entry=True)
        rt.joined = True
        rt.examples += _rows(batch, mask)
        return state

    def after_step(self, ctx: SyncContext, phase: Any, state: Any) -> Any:
        """On the host after a step: after an outer-step phase, the outer step across islands."""
        if phase is None or phase.kind != AVERAGE:
            return state
        return self._sync(ctx, state, _runtime(), entry=False)

    def _sync(self, ctx: SyncContext, state: Any, rt: _Runtime, entry: bool) -> Any:
        outer = state.sync_state
        real_opt, delta = outer.opt_state
        anchor = _host(outer.params)
        base = _Snapshot(anchor, _host(real_opt), int(jax.device_get(state.step)))
        own = None if entry else _host(delta)
        n = 0 if entry else rt.take_examples()
        if self.take_part is not None and not self.take_part(rt.manager_step()):
            n = 0
        base, mean = rt.outer_round(base, own, n)
        if entry and not rt.last["healed"] and (rt.last["members"] == 1 or base.step == 0):
            # A restarted island alone in the quorum, or with restarted islands only (none has
            # a step): no live island holds the global state. Exit (every process of the island
            # alike) with a status jddp-run does not restart.
            sys.stderr.write(
                f"jddp: island {rt.env.island} restarted but found no live island to take the "
                "global state from (every other island finished or failed): the run ends here "
                f"(exit status {EXIT_NO_PEER}); resume from a checkpoint if it must go on "
                "(docs/islands.md).\n")
            sys.stderr.flush()
            os._exit(EXIT_NO_PEER)
        return _apply(ctx.topology.replicas, self.outer, state, base, mean)


def island_env_required() -> IslandEnv:
    env = island_env()
    if env is None:
        raise RuntimeError("IslandDiLoCo runs inside `jddp-run --islands N script.py` (it needs "
                           f"{ENV_ISLAND}, {ENV_QUORUM} and {ENV_STORE}); outside, use "
                           "jddp.local_sgd.diloco(...).")
    return env


def island_diloco(period: int, outer_optimizer: optax.GradientTransformation | None = None, *,
                  outer_lr: float = 0.7, outer_momentum: float = 0.9,
                  take_part: Callable[[int], bool] | None = None) -> IslandDiLoCo:
    """DiLoCo across islands (``jddp-run --islands``): :func:`jddp.local_sgd.diloco`'s arguments,
    plus ``take_part`` (:class:`IslandDiLoCo`)."""
    if outer_optimizer is None:
        outer_optimizer = optax.sgd(outer_lr, momentum=outer_momentum, nesterov=True)
    return IslandDiLoCo(period, 0, _capture(outer_optimizer), 1, None, outer=outer_optimizer,
                        take_part=take_part)


# ------------------------------------------------------------------------------------ host side


def _rows(batch: Any, mask: Any) -> int:
    """Examples in a step's global batch (the mask's ones when there is one)."""
    if mask is not None:
        return int(np.sum(np.asarray(jax.device_get(mask)) != 0))
    leaves = jax.tree.leaves(batch)
    return int(np.shape(leaves[0])[0]) if leaves else 0


def _host(tree: Any) -> list[np.ndarray]:
    """The leaves of a replicated tree as numpy arrays (this process's copy)."""
    return [np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else np.asarray(x)
            for x in jax.tree.leaves(tree)]


class _Snapshot(NamedTuple):
    """What a healing island receives: the global parameters, the outer optimizer's state and the
    step counter, as of the start of the outer step being agreed."""

    anchor: list[np.ndarray]
    opt: list[np.ndarray]
    step: int


def _encode(snap: _Snapshot) -> dict[str, Any]:
    import torch

    def leaf(x: np.ndarray) -> Any:  # raw bytes: bit-exact whatever the dtype (bfloat16 too)
        return torch.from_numpy(np.ascontiguousarray(x).reshape(-1).view(np.uint8).copy())

    return {"anchor": [leaf(x) for x in snap.anchor], "opt": [leaf(x) for x in snap.opt],
            "step": snap.step}


def _decode(d: dict[str, Any], like: _Snapshot) -> _Snapshot:
    def leaf(t: Any, x: np.ndarray) -> np.ndarray:
        return t.numpy().view(x.dtype).reshape(x.shape).copy()

    if len(d["anchor"]) != len(like.anchor) or len(d["opt"]) != len(like.opt):
        raise RuntimeError("the healing island received a state of another model (leaf counts "
                           f"{len(d['anchor'])}/{len(d['opt'])}, here {len(like.anchor)}/"
                           f"{len(like.opt)}): every island must run the same script.")
    return _Snapshot([leaf(t, x) for t, x in zip(d["anchor"], like.anchor, strict=True)],
                     [leaf(t, x) for t, x in zip(d["opt"], like.opt, strict=True)],
                     int(d["step"]))


class _Runtime:
    """This process's torchft Manager and what it serves a healing peer (one per process)."""

    def __init__(self, env: IslandEnv) -> None:
        import torch  # noqa: F401  (torchft needs it; imported here, not with jddp)
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        self.env = env
        self.examples = 0
        self.joined = False
        self.snapshot: _Snapshot | None = None
        self.received: dict[str, Any] | None = None
        self.last: dict[str, Any] = {}
        rank, world = jax.process_index(), jax.process_count()
        host, port = env.store.rsplit(":", 1)
        timeout = timedelta(seconds=max(env.grace_s, 1.0) * 2)
        url = env.quorum if "://" in env.quorum else f"http://{env.quorum}"
        self._store = TCPStore(host, int(port), world, rank == 0,
                               timeout=timedelta(seconds=env.quorum_timeout_s),
                               wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load,
            state_dict=self._state, min_replica_size=1, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=env.quorum_timeout_s),
            connect_timeout=timedelta(seconds=60), rank=rank, world_size=world,
            store_addr=host, store_port=int(port), lighthouse_addr=url,
            replica_id=f"island{env.island}", heartbeat_interval=timedelta(milliseconds=100),
            init_sync=False)  # islands start alike (ddp.init, same params); see _sync
        atexit.register(self.manager.shutdown, wait=False)

    def _state(self) -> dict[str, Any]:
        assert self.snapshot is not None, "a peer asked for the state outside an outer step"
        return _encode(self.snapshot)

    def _load(self, d: dict[str, Any]) -> None:
        self.received = d

    def take_examples(self) -> int:
        n, self.examples = self.examples, 0
        return n

    def manager_step(self) -> int:
        return int(self.manager.current_step())

    def outer_round(self, base: _Snapshot, own: list[np.ndarray] | None,
                    n: int) -> tuple[_Snapshot, list[np.ndarray] | None]:
        """One outer step agreed with the quorum: ``(the state it starts from, the weighted mean
        delta)``; the mean is ``None`` when no member contributed an example."""
        import torch
        from torch.distributed import ReduceOp

        t0, tries = time.monotonic(), 0
        while True:
            self.snapshot, self.received = base, None
            try:
                self.manager.start_quorum()
            except Exception as e:  # torchft's own message names the Lighthouse and the wait
                raise RuntimeError(
                    f"island {self.env.island}: no quorum from the Lighthouse at "
                    f"{self.env.quorum} within {self.env.quorum_timeout_s:.0f} s "
                    f"({ENV_QUORUM_TIMEOUT}): {e}") from e
            healed = self.received is not None
            if healed:  # behind the quorum: its delta was taken from a stale start
                assert self.received is not None
                base = _decode(self.received, base)
                own, n = None, 0
            count = torch.tensor([float(n)], dtype=torch.float64)
            self.manager.allreduce(count, reduce_op=ReduceOp.SUM).wait()
            total = float(count.item())
            # The step counter everyone continues from: an island restarted before the first
            # outer step is not healed (every manager is at 0) but must not restart at step 0.
            step = torch.tensor([float(base.step)], dtype=torch.float64)
            self.manager.allreduce(step, reduce_op=ReduceOp.MAX).wait()
            base = base._replace(step=int(step.item()))
            mean = None
            if total > 0:
                w = np.float32(n / total)
                flat = np.zeros(sum(x.size for x in base.anchor), np.float32) if own is None \
                    else np.concatenate([x.astype(np.float32).reshape(-1) * w for x in own])
                buf = torch.from_numpy(flat)
                self.manager.allreduce(buf, reduce_op=ReduceOp.SUM).wait()
                mean = _unflatten(buf.numpy(), base.anchor)
            if self.manager.should_commit():
                self.last = {"outer_step": self.manager_step(), "step": base.step, "members":
                             self.manager.num_participants(), "healed": healed,
                             "examples": total, "seconds": time.monotonic() - t0,
                             "retries": tries}
                return base, mean
            tries += 1  # a member failed inside this outer step: agree on it again
            if time.monotonic() - t0 > self.env.quorum_timeout_s:
                raise RuntimeError(
                    f"island {self.env.island}: outer step {self.manager_step()} was not "
                    f"committed in {tries} tries within {self.env.quorum_timeout_s:.0f} s "
                    f"({ENV_QUORUM_TIMEOUT}); last error: {self.manager.errored()}")


def _unflatten(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    out, i = [], 0
    for x in like:
        out.append(flat[i:i + x.size].reshape(x.shape).astype(x.dtype))
        i += x.size
    return out


@functools.lru_cache(maxsize=1)
def _runtime_for(env: IslandEnv) -> _Runtime:
    return _Runtime(env)


def _runtime() -> _Runtime:
    return _runtime_for(island_env_required())


def status() -> dict[str, Any]:
    """The last outer step of this island as torchft agreed it.

    Keys: ``outer_step`` (committed outer steps), ``step`` (the training step it followed),
    ``members`` (islands in its quorum), ``healed`` (this island received the state),
    ``examples`` (summed over the members), ``seconds`` (quorum to commit), ``retries``; ``{}``
    before the first.
    """
    env = island_env()
    return {} if env is None else dict(_runtime_for(env).last)


# ------------------------------------------------------------------------------------ device side


@functools.lru_cache(maxsize=8)
def _outer_update(outer: optax.GradientTransformation) -> Callable[..., Any]:
    def update(anchor: Any, opt: Any, mean: Any) -> tuple[Any, Any]:
        step, opt = outer.update(mean, opt, anchor)
        return optax.apply_updates(anchor, step), opt

    return jax.jit(update)


def _put(like: Any, leaves: list[np.ndarray]) -> Any:
    """Numpy leaves placed as the arrays of ``like`` are (replicated on the island's mesh)."""
    def put(x: jax.Array, v: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(np.shape(v), x.sharding, lambda i: v[i])

    out = [put(x, v) for x, v in zip(jax.tree.leaves(like), leaves, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(like), out)


@functools.lru_cache(maxsize=8)
def _spread(r: int, shardings: tuple, dtypes: tuple) -> Callable[..., Any]:
    """Jitted: the global parameters broadcast to the ``r`` replicas, laid out as the step's."""
    return jax.jit(lambda leaves: tuple(jnp.broadcast_to(a.astype(d), (r, *a.shape))
                                        for a, d in zip(leaves, dtypes, strict=True)),
                   out_shardings=shardings)


def _apply(replicas: int, outer: Any, state: Any, base: _Snapshot,
           mean: list[np.ndarray] | None) -> Any:
    """The state after the agreed outer step: ``base`` moved by ``outer`` along ``mean``, the
    replicas restarted from it, the captured delta cleared."""
    real_opt, delta = state.sync_state.opt_state
    anchor, opt = _put(state.sync_state.params, base.anchor), _put(real_opt, base.opt)
    if mean is not None:
        anchor, opt = _outer_update(outer)(anchor, opt, _put(state.sync_state.params, mean))
    shardings = tuple(p.sharding for p in jax.tree.leaves(state.params))
    dtypes = tuple(p.dtype for p in jax.tree.leaves(state.params))
    spread = _spread(replicas, shardings, dtypes)
    params = jax.tree.unflatten(jax.tree.structure(state.params),
                                list(spread(tuple(jax.tree.leaves(anchor)))))
    zero = jax.tree.map(jnp.zeros_like, delta)
    step = state.step
    if int(jax.device_get(step)) != base.step:
        step = jax.device_put(jnp.asarray(base.step, step.dtype), step.sharding)
    return state.replace(params=params, sync_state=OuterState(anchor, (opt, zero)), step=step)


def fingerprint(tree: Any) -> str:
    """A hash of a tree's bits (to compare islands' global state across processes)."""
    h = hashlib.sha256()
    for x in _host(tree):
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]

