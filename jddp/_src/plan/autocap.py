"""``jddp.Buckets(cap_mb="auto")``: the bucket cap chosen for this model on this machine, once.

Each distinct candidate plan is compiled and timed round-robin on the real step; process 0's
choice is broadcast (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jddp._src.api import options
from jddp._src.plan.planner import BucketPlan, backward_sizes, bucket_sizes
from jddp._src.runtime import hostsync
from jddp._src.step import skeleton
from jddp._src.step.step import Step
from jddp._src.tree import MiB

#: Caps (MiB) that "auto" considers by default, before identical plans are merged.
DEFAULT_CANDIDATES_MB: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 50.0, 100.0)


@dataclasses.dataclass(frozen=True)
class AutoCap:
    """How ``Buckets(cap_mb="auto")`` chooses (pass an instance as ``Buckets.cap_mb`` to change it).

    Attributes:
      candidates_mb: caps to consider (MiB); caps that give the same plan are timed once.
      rounds: timed round-robin rounds per candidate (after one warm-up call each).
      margin: a cap replaces the default (25 MiB) only if its median step is at least this
        fraction faster (and faster by more than the spread of its own rounds).
      max_tune_s: bound on the tuning's wall time in seconds (compiles included), checked
        between rounds; 0 times nothing and keeps the default.
    """

    candidates_mb: tuple[float, ...] = DEFAULT_CANDIDATES_MB
    rounds: int = 5
    margin: float = 0.03
    max_tune_s: float = 120.0

    def __post_init__(self) -> None:
        check_choice(self)
        options.count(self.rounds, "AutoCap.rounds")
        if not float(self.max_tune_s) >= 0.0:
            raise ValueError(f"AutoCap.max_tune_s must be >= 0 seconds, got {self.max_tune_s!r}.")


def check_choice(policy: Any) -> None:
    """Checks (and normalises) the ``candidates_mb`` and ``margin`` of an :class:`AutoCap` or a
    ``ModelCap``."""
    name = type(policy).__name__
    caps = tuple(float(c) for c in policy.candidates_mb)
    if not caps:
        raise ValueError(f"{name}.candidates_mb must name at least one cap (MiB).")
    for c in caps:
        options.cap_bytes(c, f"{name}.candidates_mb")
    object.__setattr__(policy, "candidates_mb", caps)
    if not (0.0 <= float(policy.margin) < 1.0):
        raise ValueError(f"{name}.margin must be in [0, 1), got {policy.margin!r}.")


class CapChoice(NamedTuple):
    """What ``Buckets(cap_mb="auto")`` (timed), ``"model"`` (predicted) or the default plan (the
    same prediction, no cap given) chose, and from what.

    Attributes:
      cap_mb: the chosen cap (MiB); ``Buckets(cap_mb=cap_mb)`` pins it.
      candidates_mb: the cap timed for each distinct plan (MiB).
      num_buckets: buckets of each candidate's plan.
      median_s: each candidate's median step time (seconds), measured on process 0 (NaN when
        there was a single candidate: nothing is timed then).
      default_mb: the cap the choice was compared against (DDP's default).
      tune_s: wall time the choice took (compiles and timed steps).
      ratio: each candidate's median, over rounds, of its step time divided by the default's
        in the same round (NaN when nothing was timed).
      spread: the max - min of that ratio over the rounds: the noise it was measured with. A
        candidate is kept only when ``1 - ratio`` exceeds both ``margin`` and ``spread``.
      rounds: timed rounds (0: nothing was timed, see ``note``).
      note: why nothing was timed, or why timing stopped early (empty otherwise); with
        ``"model"``, the reason for the choice.
      method: ``"timed"`` (``Buckets(cap_mb="auto")``), ``"model"`` (the cost model, nothing
        timed: ``median_s`` is NaN, ``ratio`` is each prediction over the default's) or
        ``"default"`` (the same cost model, for a ``DataParallel`` given no cap).
      first_mb: with ``"model"``, each candidate's first bucket (MiB).
      predicted_s: with ``"model"``, each candidate's predicted time (s; NaN without a
        calibration for the platform).
      chosen_first_mb: with ``"model"``, the chosen plan's first bucket (MiB).
    """

    cap_mb: float
    candidates_mb: tuple[float, ...]
    num_buckets: tuple[int, ...]
    median_s: tuple[float, ...]
    default_mb: float
    tune_s: float
    ratio: tuple[float, ...] = ()
    spread: tuple[float, ...] = ()
    rounds: int = 0
    note: str = ""
    method: str = "timed"
    first_mb: tuple[float, ...] = ()
    predicted_s: tuple[float, ...] = ()
    chosen_first_mb: float = math.nan

    @property
    def pin(self) -> str:
        """The ``DataParallel`` arguments that give the chosen plan without choosing again."""
        if self.method == "timed" or self.chosen_first_mb == self.cap_mb:
            return f"reduce=jddp.Buckets(cap_mb={self.cap_mb:g})"
        return f"reduce=jddp.Buckets(cap_mb={self.cap_mb:g}, first_mb={self.chosen_first_mb:g})"

    @property
    def caps(self) -> tuple[int, int]:
        """The chosen ``(cap, first)`` in bytes (the first clipped to the cap)."""
        cap = options.cap_bytes(self.cap_mb, "bucket_cap_mb")
        return cap, min(options.cap_bytes(self.chosen_first_mb, "first_bucket_mb"), cap)

    def table(self) -> str:
        if self.method != "timed":
            return _model_table(self)
        rows = [f"Buckets(cap_mb='auto') chose {self.cap_mb:g} MiB (pin it with "
                f"{self.pin}); tuning took {self.tune_s:.1f} s, "
                f"{self.rounds} timed round(s)",
                f"{'cap MiB':>8} {'buckets':>7} {'median ms':>10} {'vs default':>10} "
                f"{'spread':>7}"]
        nan = (math.nan,) * len(self.candidates_mb)
        for cap, nb, t, r, sp in zip(self.candidates_mb, self.num_buckets, self.median_s,
                                     self.ratio or nan, self.spread or nan, strict=True):
            mark = "  <- chosen" if cap == self.cap_mb else ""
            rows.append(f"{cap:>8g} {nb:>7} {t * 1e3:>10.2f} {r:>10.3f} {sp:>7.3f}{mark}")
        if self.note:
            rows.append(self.note)
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _model_table(c: CapChoice) -> str:
    """``CapChoice.table`` for ``Buckets(cap_mb="model")`` and the default plan: each candidate's
    prediction."""
    who = "Buckets(cap_mb='model')" if c.method == "model" else "the default plan (no cap given)"
    rows = [f"{who} chose cap {c.cap_mb:g} MiB, first bucket "
            f"{min(c.chosen_first_mb, c.cap_mb):g} MiB (pin it with {c.pin}); nothing timed: "
            f"{c.note}",
            f"{'cap MiB':>8} {'first MiB':>9} {'buckets':>7} {'predicted ms':>12} "
            f"{'vs default':>10}"]
    for cap, first, nb, p, r in zip(c.candidates_mb, c.first_mb, c.num_buckets, c.predicted_s,
                                    c.ratio, strict=True):
        mark = "  <- chosen" if (cap, first) == (c.cap_mb, c.chosen_first_mb) else ""
        mark += "  (DDP's default)" if (cap, first) == (c.candidates_mb[0], c.first_mb[0]) else ""
        rows.append(f"{cap:>8g} {min(first, cap):>9g} {nb:>7} {p * 1e3:>12.2f} {r:>10.3f}{mark}")
    return "\n".join(rows)


def resolve(bucket_cap_mb: Any) -> AutoCap | None:
    """The :class:`AutoCap` policy for ``"auto"`` or an ``AutoCap``; ``None`` for a number."""
    if isinstance(bucket_cap_mb, AutoCap):
        return bucket_cap_mb
    if isinstance(bucket_cap_mb, str):
        if bucket_cap_mb != "auto":
            raise ValueError(
                f"Buckets.cap_mb must be a number of MiB, 'auto' (timed) or 'model' (the cost "
                f"model, no timing), got {bucket_cap_mb!r}."
            )
        return AutoCap()
    return None


def distinct_candidates(
    plan: BucketPlan, caps_mb: Sequence[float], first_bytes: int, default_mb: float,
    tolerance: float = 0.01,
) -> list[tuple[float, int]]:
    """``(cap_mb, num_buckets)`` of each distinct plan among ``caps_mb`` (and the default): caps
    alike when they make as many buckets of bytes within ``tolerance`` of the model's gradient
    bytes; each group is timed under its smallest cap (the default under the default).
    """
    nbytes, dtypes = backward_sizes(plan)
    slack = tolerance * max(1, sum(nbytes))
    first_mb = first_bytes / MiB
    kept = [(default_mb, bucket_sizes(nbytes, dtypes, default_mb, first_mb))]
    for cap_mb in sorted(set(caps_mb) - {default_mb}):
        mine = bucket_sizes(nbytes, dtypes, cap_mb, first_mb)
        if not any(len(mine) == len(other) and
                   all(abs(a - b) <= slack for a, b in zip(mine, other, strict=True))
                   for _, other in kept):
            kept.append((cap_mb, mine))
    return sorted((cap, len(s)) for cap, s in kept)


class Verdict(NamedTuple):
    """What :func:`pick` decided: the cap, and each candidate's ratio to the default (median
    over rounds) and the spread of that ratio (max - min)."""

    cap_mb: float
    ratio: tuple[float, ...]
    spread: tuple[float, ...]


def pick(caps_mb: Sequence[float], times: Sequence[Sequence[float]], default_mb: float,
         margin: float) -> Verdict:
    """The cap with the largest gain over ``default_mb`` among those whose gain exceeds both
    ``margin`` and the spread of their own rounds (round ``r`` against the default's round
    ``r``); else the default.
    """
    n = len(caps_mb)
    d = list(caps_mb).index(default_mb)
    rounds = min((len(t) for t in times), default=0)
    if n == 1 or rounds < 2:  # one round measures no spread: nothing is kept above the noise
        return Verdict(float(default_mb), (math.nan,) * n, (math.nan,) * n)
    t = np.array([list(x)[:rounds] for x in times], dtype=np.float64)
    ratios = t / t[d]
    ratio, spread = np.median(ratios, axis=1), ratios.max(axis=1) - ratios.min(axis=1)
    gain = 1.0 - ratio
    kept = [i for i in range(n) if i != d and gain[i] > max(margin, spread[i])]
    best = max(kept, key=lambda i: gain[i]) if kept else d
    return Verdict(float(caps_mb[best]), tuple(float(r) for r in ratio),
                   tuple(float(x) for x in spread))


def _agree(value: float) -> float:
    """Process 0's value on every process (the same cap compiles the same program everywhere)."""
    if jax.process_count() == 1:
        return value
    return float(hostsync.broadcast_from_process0(np.float64(value)))


def _copier(state: Any) -> Callable[[Any], Any]:
    """A jitted copy of ``state`` with its shardings: fresh buffers for a donating candidate to
    consume (jitted, so that arrays spanning several processes are copied too)."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(lambda s: jax.tree.map(lambda x: x.copy(), s), out_shardings=shardings)


class _Forward:
    """A candidate step's plan observer: keeps its plan; once chosen, reports to the trainer."""

    def __init__(self) -> None:
        self.latest: BucketPlan | None = None
        self.target: Callable[[BucketPlan], None] | None = None

    def __call__(self, plan: BucketPlan) -> None:
        self.latest = plan
        if self.target is not None:
            self.target(plan)


class Candidates(NamedTuple):
    """What a choosing step needs of the step's configuration (not the configuration itself).

    Attributes:
      cap_bytes, first_bytes: the default caps (the plan a choice is compared against).
      build: ``build(cap_bytes, first_bytes, observer) -> Step``: the step with other caps.
      plan: ``plan(state, batch, mask, rng) -> BucketPlan``: the default step's plan (traced).
      reducing: the ``sync`` of a call that reduces (with accumulation, the others send nothing).
    """

    cap_bytes: int
    first_bytes: int
    build: Callable[[int, int, skeleton.PlanObserver], Step]
    plan: Callable[..., BucketPlan]
    reducing: Callable[[bool | None], bool | None]
    platform: str
    num_devices: int


class ChoosingStep:
    """A ``ddp.step`` that picks its bucket plan once, on the first call, then is the chosen
    :class:`Step`: shared by ``Buckets(cap_mb="auto")`` and ``"model"``.

    Args:
      on_choice: called once with the chosen :class:`Step` and the :class:`CapChoice`.
    """

    def __init__(
        self,
        candidates: Candidates,
        policy: Any,
        observer: skeleton.PlanObserver,
        on_choice: Callable[[Step, CapChoice], None],
    ) -> None:
        self._candidates = candidates
        self._policy = policy
        self._observer = observer
        self._on_choice = on_choice
        self._step: Step | None = None
        self.choice: CapChoice | None = None

    def cache_size(self) -> int:
        """Programs the chosen step has compiled (0 before the choice)."""
        return 0 if self._step is None else self._step.cache_size()


class AutoStep(ChoosingStep):
    """``ddp.step`` when ``Buckets(cap_mb="auto")``: chooses the cap on the first call (timing the
    candidates), then is the chosen :class:`Step`. Arguments as :class:`ChoosingStep`'s, with an
    :class:`AutoCap` policy."""

    _policy: AutoCap

    def tune(self, state: Any, batch: Any, mask: Any = None, *, sync: bool | None = None,
             rng: Any = None) -> CapChoice:
        """Chooses the cap on these inputs (their values are not changed); once only."""
        if self.choice is not None:
            return self.choice
        t0 = time.perf_counter()
        cands, policy, first = self._candidates, self._policy, self._candidates.first_bytes
        default_mb = cands.cap_bytes / MiB
        plan = cands.plan(state, batch, mask, rng)
        found = distinct_candidates(plan, policy.candidates_mb, first, default_mb)
        caps = [c for c, _ in found]
        steps, observers = [], []
        for cap_mb in caps:
            cap = options.cap_bytes(cap_mb, "bucket_cap_mb")
            observers.append(_Forward())
            steps.append(cands.build(cap, min(first, cap), observers[-1]))
        # With accumulation, time the synchronising program: the others have no collective.
        tsync = cands.reducing(sync)
        times: list[list[float]] = [[] for _ in caps]
        # One distinct plan (a small model, or one dominated by a leaf above every cap): nothing
        # to choose between, so nothing is timed; the step compiles on its first real call.
        rounds = policy.rounds + 1 if len(caps) > 1 else 0
        note = "" if rounds else "nothing was timed: every candidate cap gives the same plan"
        copy = _copier(state) if rounds and steps[0].donates else None
        deadline = t0 + float(policy.max_tune_s)
        for r in range(rounds):  # round 0 compiles and warms up, untimed
            # Every process must run the same rounds (they hold collectives): process 0 decides.
            if _agree(float(time.perf_counter() < deadline)) < 0.5:
                note = (f"timing stopped at the time bound (max_tune_s={policy.max_tune_s:g}) "
                        f"after {max(0, r - 1)} timed round(s)"
                        + ("; fewer than 2: no spread measured, the default is kept"
                           if r - 1 < 2 else ""))
                break
            for i, step in enumerate(steps):
                trial = state if copy is None else copy(state)
                jax.block_until_ready(trial)
                t = time.perf_counter()
                jax.block_until_ready(step(trial, batch, mask, sync=tsync, rng=rng))
                if r:
                    times[i].append(time.perf_counter() - t)
        medians = [float(np.median(t)) if t else math.nan for t in times]
        verdict = pick(caps, times, default_mb, policy.margin)
        chosen = _agree(verdict.cap_mb)
        k = caps.index(chosen)  # the candidates are the same on every process
        self._step = steps[k]
        observers[k].target = self._observer
        latest = observers[k].latest
        if latest is not None:
            self._observer(latest)
        self.choice = CapChoice(float(chosen), tuple(caps), tuple(n for _, n in found),
                                tuple(medians), default_mb, time.perf_counter() - t0,
                                verdict.ratio, verdict.spread, min(len(t) for t in times),
                                note)
        self._on_choice(self._step, self.choice)
        return self.choice

    def chosen_step(self, what: str = "run") -> Step:
        """The chosen :class:`Step`; a clear error (naming ``what``) before the choice."""
        if self._step is None:
            raise ValueError(
                f"Buckets(cap_mb='auto') has not chosen a cap yet, so there is no program to "
                f"{what}: take one step (ddp.step(state, batch)) or call ddp.step.tune(state, "
                "batch) first, or pin the cap with a number (jddp.Buckets(cap_mb=25.0))."
            )
        return self._step

    def __call__(self, state: Any, batch: Any, mask: Any = None, *, sync: bool | None = None,
                 rng: Any = None) -> Any:
        if self._step is None:
            self.tune(state, batch, mask, sync=sync, rng=rng)
        return self.chosen_step("run")(state, batch, mask, sync=sync, rng=rng)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The chosen step's :meth:`Step.lower` (after the choice)."""
        return self.chosen_step("lower").lower(*args, **kwargs)
