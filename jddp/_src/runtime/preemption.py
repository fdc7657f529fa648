"""The preemption point (`reached_preemption_point`), the exits after it (`exit_for_resume`,
`hard_exit`), and a bounded grace between a preemption notice (SIGTERM) and that point.

A daemon thread ends the process with 143 when it does not reach the preemption point in time
(``grace_s`` after the notice, plus twice its longest interval between asks once it asked:
docs/faults.md, "Preemption and resuming"). Every caller of JAX's sync point counts: the
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
from typing import Any, NoReturn

from jax.experimental import multihost_utils

from jddp._src.introspect import jax_private
from jddp._src.runtime import coordinator, watchdog
from jddp._src.runtime.coordinator import EXIT_RESUME

__all__ = ["DEFAULT_GRACE_S", "NOTICE_KEY", "Grace", "current", "exit_for_resume", "hard_exit",
           "reached_preemption_point", "start"]

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
      distributed_state: ``jax_private.distributed_state()`` of a multi-process job with the
        preemption service on; None in a single process (the watch starts on `note_notice`).
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


def hard_exit(status: int = 1) -> NoReturn:
    """Ends this process now with `status`, without waiting for the other processes.

    Use it instead of `sys.exit(status)` to fail a rank of a multi-process job: a normal exit
    runs JAX's shutdown, which waits (up to the shutdown timeout) for every other process to
    finish too, and may turn the status into an abort (134) when they do not.
    """
    if status == 0:
        watchdog.announce_exit()  # as atexit would have: jddp-run's early-exit check needs it
    watchdog.flush_and_exit(status)


def exit_for_resume(leave_timeout_s: float = 30.0) -> NoReturn:
    """Ends this process with `EXIT_RESUME` (75): preempted, checkpoint saved, resume me.

    Call it on every process once the preemption checkpoint is saved
    (`jddp.checkpoint.save_if_due` does). Every process reaches this point at the same step, so
    in a multi-process job they leave `jax.distributed` together (its shutdown barrier) before
    exiting: process 0 hosts the coordination service, and an abrupt exit there would cut off
    the RPCs the others still have in flight (an orbax barrier's reply, their error polling),
    which ends them with status 1 or an abort (134) instead of 75.

    Args:
      leave_timeout_s: bound on that shutdown; a process still waiting then (another process
        never arrived) exits with 75 anyway.
    """
    _leave_distributed(leave_timeout_s, EXIT_RESUME)
    hard_exit(EXIT_RESUME)


def _leave_distributed(timeout_s: float, status: int) -> None:
    """Disconnects from `jax.distributed` with its shutdown barrier, bounded by `timeout_s`."""
    if jax_private.coordination_client() is None:
        return
    grace = current()
    if grace is not None:
        grace.stop()  # its thread must not be inside a call to the client that shuts down
    timer = coordinator.exit_timer(
        timeout_s, f"jddp: process {jax_private.distributed_state().process_id} waited "
        f"{timeout_s:.0f} s for the other processes to leave the job; exiting with {status}",
        status=status)
    try:
        jax_private.shutdown_distributed()
    except Exception as e:  # a peer already gone: exiting is all that is left to do
        sys.stderr.write(f"jddp: leaving jax.distributed: {e}\n")
    finally:
        timer.cancel()


_sigterm_seen = threading.Event()  # single-process preemption notice (see reached_preemption_point)
_grace_s: float | None = DEFAULT_GRACE_S  # initialize(preemption_grace_s=...)


def set_single_process_grace(grace_s: float | None) -> None:
    """The bound of a single process's watch (set up on its first ask), from `initialize`."""
    global _grace_s
    _grace_s = grace_s


def _single_process_grace() -> Grace | None:
    """The single process's preemption watch (set up on first use), None without a bound."""
    grace = current()
    if grace is None and _grace_s is not None:
        grace = start(_grace_s, 0, None)
    return grace


def _on_sigterm(signum: int, frame: Any) -> None:
    _sigterm_seen.set()
    # A second SIGTERM does what SIGTERM did before: end the process.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    grace = _single_process_grace()
    if grace is not None:
        grace.note_notice()
        grace.start_thread(None)


def reached_preemption_point(step: int) -> bool:
    """True at the step where every process should save a checkpoint and exit, after SIGTERM.

    Call it once per training step, with increasing `step`, on every process. In a multi-process
    job (`jax.distributed` initialised, preemption service on) this is JAX's
    `multihost_utils.reached_preemption_sync_point`: a SIGTERM to any process is a preemption
    notice, and every process gets True at the same step, the one after the highest step any of
    them had reached (about 1 s after the signal in our runs). In a single process the first call
    installs a SIGTERM handler (main thread only, and only over the default action) and later
    calls return True once a SIGTERM came; a second SIGTERM ends the process as usual.

    Args:
      step: the host-side step number (e.g. `state.step` after the update).
    """
    if jax_private.coordination_client() is not None:
        try:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:
            return False  # the preemption service is off: SIGTERM simply ends the process
    grace = _single_process_grace()
    if grace is not None:
        grace.note_ask(_sigterm_seen.is_set())
    if _sigterm_seen.is_set():
        return True
    # Only over the default action: a handler of the program's own is left alone.
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)
    return False
