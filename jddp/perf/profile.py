"""Where a real step's time goes: host dispatch, device time, and time in each bucket's collectives.

Example (``examples/train_digits.py --profile DIR`` does this)::

    timer = jddp.perf.profile.StepTimer(ddp.step)
    with jddp.perf.profile.trace(DIR, ddp.step.lower(state, batch).compile()) as t:
        for batch in batches[:5]:
            state, metrics = timer(state, batch)
    print(timer.summary(), t.collectives)
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import gzip
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jddp._src.introspect import hlo

__all__ = ["CollectiveTime", "StepTimer", "Trace", "collective_times", "name_collectives",
           "trace"]


class StepTimer:
    """``ddp.step`` with the host dispatch and device time of every call recorded.

    Args:
      step: ``ddp.step`` (or any jitted step returning arrays).
    """

    def __init__(self, step: Callable[..., Any]) -> None:
        self._step = step
        self.dispatch_s: list[float] = []
        self.device_s: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._step(*args, **kwargs)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        self.dispatch_s.append(t1 - t0)
        self.device_s.append(time.perf_counter() - t1)
        return out

    def summary(self, skip: int = 1) -> dict[str, float]:
        """Medians in milliseconds over the calls after the first ``skip`` (compilation)."""
        d, v = self.dispatch_s[skip:] or self.dispatch_s, self.device_s[skip:] or self.device_s
        if not d:
            return {"steps": 0}
        return {"steps": len(d), "dispatch_ms": 1e3 * statistics.median(d),
                "device_ms": 1e3 * statistics.median(v),
                "step_ms": 1e3 * statistics.median(a + b for a, b in zip(d, v, strict=True))}


@dataclasses.dataclass(frozen=True)
class CollectiveTime:
    """Time the devices spent in one collective of the program, over a trace.

    Attributes:
      name: the HLO instruction (``all-reduce.1``; ``all-reduce-start.1`` on GPU).
      kind: its collective kind.
      bucket: the gradient bucket it serves (``None``: outside every bucket).
      calls: how many times it ran, over all devices.
      mean_ms: mean duration of one run on one device (waiting for the slowest peer included:
        on CPU the collective's thread waits at the rendezvous).
    """

    name: str
    kind: str
    bucket: int | None
    calls: int
    mean_ms: float


def _instruction_buckets(compiled: Any) -> dict[str, tuple[str, int | None]]:
    """HLO instruction name -> (collective kind, bucket) for every collective of a program."""
    out: dict[str, tuple[str, int | None]] = {}
    for c in hlo.collectives(compiled):
        out[c.name] = (c.kind, c.bucket)
        done = c.name.replace("-start", "-done")
        if done != c.name:
            out[done] = (c.kind, c.bucket)
    return out


def _perfetto_files(directory: str, skip: frozenset[str] = frozenset()) -> list[str]:
    return sorted(set(glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"),
                                recursive=True)) - skip)


def _events(data: Any) -> list[dict]:
    return data["traceEvents"] if isinstance(data, dict) else data


def name_collectives(directory: str, compiled: Any, skip: frozenset[str] = frozenset()) -> int:
    """Renames the collectives of ``compiled`` in the Perfetto traces under ``directory`` after
    their bucket (``all-reduce.1`` -> ``all-reduce.1 [jddp_bucket_1]``); returns how many events
    were renamed. The TensorBoard ``.xplane.pb`` keeps XLA's names (its op details show the
    ``op_name`` with the bucket's scope on GPU)."""
    names = _instruction_buckets(compiled)
    renamed = 0
    for path in _perfetto_files(directory, skip):
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        for e in _events(data):
            got = names.get(e.get("name", ""))
            if got is not None and got[1] is not None:
                e["name"] = f"{e['name']} [{hlo.bucket_scope(got[1])}]"
                renamed += 1
        with gzip.open(path, "wt") as f:
            json.dump(data, f)
    return renamed


def collective_times(
    directory: str, compiled: Any, skip: frozenset[str] = frozenset()
) -> list[CollectiveTime]:
    """The time spent in each collective of ``compiled``, read from the Perfetto traces under
    ``directory`` but not in ``skip`` (events named after the HLO instruction, renamed or
    not)."""
    names = _instruction_buckets(compiled)
    durations: dict[str, list[float]] = {}
    for path in _perfetto_files(directory, skip):
        with gzip.open(path, "rt") as f:
            events = _events(json.load(f))
        for e in events:
            name = e.get("name", "").split(" [")[0]
            if name in names and e.get("ph") == "X" and "dur" in e:
                durations.setdefault(name, []).append(float(e["dur"]) / 1e3)
    return [CollectiveTime(n, names[n][0], names[n][1], len(d), statistics.fmean(d))
            for n, d in durations.items()]


@dataclasses.dataclass
class Trace:
    """What :func:`trace` found: the trace directory and the time in each collective."""

    directory: str
    collectives: list[CollectiveTime] = dataclasses.field(default_factory=list)
    renamed: int = 0

    def per_step_ms(self, steps: int, devices: int) -> float:
        """Mean time one device spent in collectives per step, over ``steps`` traced steps."""
        total = sum(c.mean_ms * c.calls for c in self.collectives)
        return total / max(1, steps * devices)


@contextlib.contextmanager
def trace(directory: str, compiled: Any) -> Iterator[Trace]:
    """``jax.profiler.trace`` into ``directory`` (TensorBoard and Perfetto files), then the
    step's collectives named after their buckets and timed (:class:`Trace`).

    Args:
      compiled: the step's compiled program (``ddp.step.lower(state, batch).compile()``; the
        step reuses that compile), whose collectives are named.
    """
    out = Trace(directory)
    earlier = frozenset(_perfetto_files(directory))  # traces of earlier runs stay as they are
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        yield out
    out.renamed = name_collectives(directory, compiled, earlier)
    out.collectives = collective_times(directory, compiled, earlier)
