"""A bounded grace between a preemption notice (SIGTERM) and the preemption point.

With JAX's preemption service on, a multi-process rank does not die of SIGTERM: JAX records it
as a preemption notice, and every rank saves at the same later step when the loop asks
``reached_preemption_point``. A rank that never gets there ran on until a SIGKILL: a script with
no preemption checkpoints, or a rank stuck in a collective with a dead peer (under ``srun
--kill-on-bad-exit`` slurmstepd's SIGTERM is exactly that, and SLURM's KillWait, 30 s by default,
passed before the job ended). Here a daemon thread watches for the notice and ends the process
with 143 (as SIGTERM would have) when it does not reach the preemption point in time:

* the notice: in a multi-process job, JAX's key ``RECEIVED_PREEMPTION_NOTICE`` in the
  coordination service (a SIGTERM to any rank sets it; every rank sees it); in a single process,
  jddp's own SIGTERM handler;
* the deadline: ``grace_s`` after the notice if the process never asked for the preemption point
  (it has no preemption checkpoints, or it is still starting up); otherwise ``grace_s`` plus twice
  its longest interval between recent asks, after the later of the notice and its last ask, so a
  loop that keeps asking is never cut short;
* reaching the point (the ask returns True) ends the watch: saving may take as long as it takes.

Every caller of JAX's sync point counts (orbax's ``CheckpointManager`` asks it directly): the
process-wide sync manager is wrapped in a counting proxy.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from jddp._src.introspect import jax_private
from jddp._src.runtime import watchdog

__all__ = ["DEFAULT_GRACE_S", "NOTICE_KEY", "Grace", "current", "start"]

DEFAULT_GRACE_S = 4.0
NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"  # set by XLA's PreemptionSyncManager on a notice
POLL_S = 0.25  # one cheap key look-up per poll; the grace is seconds
_HISTORY = 16  # recent asks that set the expected interval


class Grace:
    """The state of one process's watch: its asks for the preemption point, and the notice."""

    def __init__(self, grace_s: float, rank: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = float(grace_s)
        self.rank = rank
        self._clock = clock  # a parameter for the tests
        self.asks: collections.deque[float] = collections.deque(maxlen=_HISTORY + 1)
        self.notice_at: float | None = None
        self.reached = False
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def note_ask(self, reached: bool) -> None:
        """Records an ask for the preemption point (from the training thread)."""
        self.asks.append(self._clock())
        if reached:
            self.reached = True
            self.stopped.set()

    def note_notice(self) -> None:
        if self.notice_at is None:
            self.notice_at = self._clock()

    def deadline(self) -> float | None:
        """When this process is out of time, or None (no notice, or the point was reached)."""
        notice, asks = self.notice_at, list(self.asks)
        if notice is None or self.reached:
            return None
        if not asks:
            return notice + self.grace_s
        longest = max((b - a for a, b in itertools.pairwise(asks)), default=0.0)
        return max(notice, asks[-1]) + self.grace_s + 2.0 * longest

    def _expire(self) -> None:
        asked = bool(self.asks)
        why = ("it stopped asking for the preemption point (a step stuck in a collective with a "
               "lost peer, or a long pause in the loop: raise "
               "jddp.initialize(preemption_grace_s=...))" if asked else
               "it never asked for the preemption point (no jddp.checkpoint.save_if_due or "
               "jddp.distributed.reached_preemption_point in its loop, or still starting up)")
        since = self._clock() - (self.notice_at or 0.0)
        sys.stderr.write(
            f"jddp: process {self.rank}: preemption notice (SIGTERM) {since:.1f} s ago, and "
            f"{why}; exiting with status {128 + signal.SIGTERM} as SIGTERM would\n")
        watchdog.flush_and_exit(128 + signal.SIGTERM)

    def _run(self, client: Any) -> None:
        while not self.stopped.is_set():
            if self.notice_at is None and client is not None:
                try:
                    client.key_value_try_get(NOTICE_KEY)
                    self.note_notice()
                except Exception:  # NOT_FOUND until a notice; any other error: try again
                    pass
            deadline = self.deadline()
            if deadline is not None and self._clock() > deadline:
                self._expire()
            self.stopped.wait(POLL_S)

    def start_thread(self, client: Any) -> None:
        """Starts the watch (``client``: JAX's distributed client to poll; None: the notice
        comes from `note_notice`); idempotent."""
        with self._lock:
            if self._thread is not None or self.stopped.is_set():
                return
            self._thread = threading.Thread(target=self._run, args=(client,),
                                            name="jddp-preemption-grace", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Ends the watch and waits for its thread: it must not be inside a call to JAX's client
        when that shuts down (the interpreter's exit then aborts)."""
        self.stopped.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)


class _CountingSyncManager:
    """JAX's preemption sync manager, with each `reached_sync_point` recorded in a `Grace`."""

    def __init__(self, inner: Any, grace: Grace) -> None:
        self._inner = inner
        self._grace = grace

    def reached_sync_point(self, step: int) -> bool:
        reached = bool(self._inner.reached_sync_point(step))
        self._grace.note_ask(reached)
        return reached

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_current: Grace | None = None


def current() -> Grace | None:
    """This process's watch, if one was set up."""
    return _current


def start(grace_s: float, rank: int, distributed_state: Any | None) -> Grace:
    """Sets up this process's watch.

    Args:
      distributed_state: ``jax_private.distributed_state()`` of a multi-process job with
        the preemption service on: its sync manager is wrapped and its client polled for the
        notice, from now on. None in a single process: the watch starts on `note_notice` (jddp's
        SIGTERM handler), and asks are recorded by the caller.
    """
    global _current
    grace = Grace(grace_s, rank)
    _current = grace
    # After `import jax`, so it runs before JAX's own exit handler shuts the client down.
    atexit.register(grace.stop)
    if distributed_state is not None:
        manager = jax_private.preemption_sync_manager(distributed_state)
        if manager is not None and not isinstance(manager, _CountingSyncManager):
            jax_private.set_preemption_sync_manager(
                distributed_state, _CountingSyncManager(manager, grace))
            grace.start_thread(distributed_state.client)
    return grace
