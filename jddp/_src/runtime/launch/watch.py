"""One attempt of a `jddp-run` job, watched: the ranks' reports over their sockets, and the
rules that end the attempt (a rank failing, the watchdog, an early exit, preemption, signals,
the other nodes' orders)."""

from __future__ import annotations

import dataclasses
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from jddp._src.runtime import multinode, watchdog
from jddp._src.runtime.coordinator import EXIT_RESUME
from jddp._src.runtime.launch.procs import (
    EXIT_EARLY,
    EXIT_STUCK,
    EXIT_TIMEOUT,
    POLL_S,
    ErrorLine,
    Guardian,
    describe,
    exit_status,
    note,
    signal_groups,
    terminate,
)


@dataclasses.dataclass
class RankProgress:
    """What a rank told the launcher (written by the reader thread, read by the main loop)."""

    completed: int = -1  # highest step completed (-1: none)
    dispatched: int = -1  # highest step started
    exiting: bool = False  # announced a normal exit


class Links:
    """The launcher's ends of the ranks' sockets, and a thread that reads their reports."""

    def __init__(self, socks: list[socket.socket], start: float) -> None:
        self.socks = socks
        self.lock = threading.Lock()
        self.ranks = [RankProgress() for _ in socks]
        self.last_progress = start  # when any rank last completed a new step (or the start)
        self.any_completed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="jddp-run-reports", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        links = {s: watchdog.Lines(s) for s in self.socks}
        rank_of = {s: r for r, s in enumerate(self.socks)}
        while links and not self._stop.is_set():
            try:
                readable, _, _ = select.select(list(links), [], [], 0.1)
            except (OSError, ValueError):
                return
            for s in readable:
                lines = links[s].read()
                if lines is None:
                    del links[s]
                    continue
                for line in lines:
                    self._update(rank_of[s], line)

    def _update(self, rank: int, line: str) -> None:
        parts = line.split()
        if len(parts) != 3 or parts[0] not in ("p", "x"):
            return
        try:
            completed, dispatched = int(parts[1]), int(parts[2])
        except ValueError:
            return
        with self.lock:
            r = self.ranks[rank]
            if completed > r.completed:
                r.completed = completed
                self.last_progress = time.monotonic()
                self.any_completed = True
            r.dispatched = max(r.dispatched, dispatched)
            r.exiting = r.exiting or parts[0] == "x"

    def snapshot(self) -> tuple[list[RankProgress], float, bool]:
        with self.lock:
            return ([dataclasses.replace(r) for r in self.ranks], self.last_progress,
                    self.any_completed)

    def abort(self, ranks: Sequence[int], status: int) -> None:
        """Orders `ranks` to exit now with `status` (ranks running jddp's thread obey at once)."""
        for r in ranks:
            try:
                self.socks[r].send(b"abort %d\n" % status, socket.MSG_DONTWAIT)
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        for s in self.socks:
            s.close()


def _progress_lines(progress: Mapping[int, RankProgress], ranks: Sequence[int],
                    label: Callable[[int], str]) -> str:
    """One phrase per rank: its last completed step, the step it is in, and who the others wait for.

    A rank that has not started the step the others are in holds them up (it is stuck outside
    the training step: input pipeline, evaluation, ...); so does one that is behind.
    """
    parts = []
    furthest = max((progress[r].dispatched for r in ranks), default=-1)
    for r in ranks:
        p = progress[r]
        done = f"last completed step {p.completed}" if p.completed >= 0 else "no step completed"
        if p.dispatched > p.completed:
            where = f", in step {p.dispatched}"
        else:
            where = ", not inside a step"
        mark = " <- the others wait for it" if p.dispatched < furthest else ""
        parts.append(f"{label(r)}: {done}{where}{mark}")
    return "; ".join(parts)


def _early_exit(progress: Mapping[int, RankProgress], exited_ok: set[int],
                running: set[int], label: Callable[[int], str]) -> str | None:
    """A message if a rank left normally while another is inside a step it never started."""
    leavers = [r for r in sorted(exited_ok | {q for q in running if progress[q].exiting})]
    for r in leavers:
        last = progress[r].dispatched
        waiting = [s for s in sorted(running) if not progress[s].exiting
                   and progress[s].dispatched > last]
        if waiting:
            step = "before its first step" if last < 0 else f"after step {last}"
            who = ", ".join(f"{label(s)} (in step {progress[s].dispatched})" for s in waiting)
            # An announced exit is the end of the script or sys.exit(n), whatever n: Python
            # does not tell atexit handlers the status (jddp.distributed.hard_exit(n) does not
            # announce, so its status reaches the launcher).
            verb = ("exited with status 0" if r in exited_ok
                    else "is exiting (end of script or sys.exit)")
            return (f"{label(r)} {verb} {step} while {who} waits for it inside a step that "
                    "needs every rank")
    return None


class Outcome(NamedTuple):
    """How one attempt of the job ended."""

    status: int
    reason: str  # why, for the restart message ("" on success)
    restartable: bool
    time: float = 0.0  # when the cause was seen (Unix time), which orders failures across nodes
    ranks: tuple[multinode.RankEnd, ...] = ()  # how each of this node's ranks ended


@dataclasses.dataclass(frozen=True)
class Options:
    command: tuple[str, ...]
    num_processes: int
    devices_per_process: int | None
    grace_s: float
    preemption_grace_s: float
    step_timeout_s: float | None
    first_step_timeout_s: float | None
    deadline: float | None  # monotonic time at which --timeout ends the job
    timeout_s: float | None
    base_env: Mapping[str, str]
    prefix_output: bool
    rank_offset: int = 0  # global rank of this node's first rank (multi-node)
    world_size: int | None = None  # ranks on all nodes (None: num_processes)
    nnodes: int = 1


def label(options: Options, rank: int) -> str:
    """``rank 3``, or ``rank 3 (node 1)`` in a multi-node job (``rank``: global)."""
    if options.nnodes > 1:
        return f"rank {rank} (node {rank // options.num_processes})"
    return f"rank {rank}"


def statuses(options: Options, ranks: Sequence[multinode.RankEnd]) -> str:
    """Every rank's exit status, for the note at the end of a failed job."""
    return "; ".join(
        f"{label(options, r.rank)}: {describe(r.status)}"
        f"{', ended by jddp-run' if r.ended else ''}" for r in ranks)


class Watcher:
    """One attempt's loop: waits for the ranks, and decides when and how the attempt ends.

    ``peer`` is the other nodes' agents: their orders end this node's ranks too. Node 0's agent
    (``multinode.Master``) judges progress (the watchdog, the early-exit rule) over every node's
    ranks; the others forward their ranks' progress to it.
    """

    def __init__(self, options: Options, procs: Sequence[subprocess.Popen], links: Links,
                 guardian: Guardian, signals: list[int],
                 peer: multinode.Master | multinode.Worker | None,
                 errors: Sequence[ErrorLine], pumps: Sequence[Sequence[threading.Thread]]):
        self.options, self.procs, self.links, self.guardian = options, procs, links, guardian
        self.signals, self.peer, self.errors, self.pumps = signals, peer, errors, pumps
        self.running = set(range(len(procs)))  # local ranks
        self.exited_ok: set[int] = set()  # exited with status 0
        self.resumable: set[int] = set()  # exited with EXIT_RESUME
        self.statuses: dict[int, int] = {}  # the status each rank that ended by itself gave
        self.preempt_deadline: float | None = None  # set once a preemption is under way
        self.launcher_preempted = False
        self.handled_signals = 0

    def label(self, rank: int) -> str:
        return label(self.options, rank)

    def run(self) -> Outcome:
        while True:
            now = time.monotonic()
            if isinstance(self.peer, multinode.Worker):
                self._forward_progress()
            outcome = (self._reap(now) or self._obey_signals(now) or self._timeout(now)
                       or self._follow_peer(now))
            if outcome is None and self.preempt_deadline is not None:
                # Ranks are saving: neither the watchdog nor the early-exit rule apply.
                outcome = self._preemption_over(now)
            elif outcome is None:
                outcome = self._check_progress(now)
            if outcome is not None:
                return outcome
            time.sleep(POLL_S)

    def end(self, status: int, reason: str, restartable: bool,
            when: float | None = None) -> Outcome:
        """Ends the running ranks; ``when``: the cause's time (default now)."""
        when = time.time() if when is None else when
        note(f"{reason}; ending the job ({describe(status)})")
        ranks = sorted(self.running)
        self.links.abort(ranks, 128 + signal.SIGTERM)
        terminate([self.procs[r] for r in ranks], self.options.grace_s)
        return self._outcome(status, reason, restartable, when)

    def _outcome(self, status: int, reason: str, restartable: bool, when: float) -> Outcome:
        ranks = tuple(
            multinode.RankEnd(self.options.rank_offset + r, self.statuses[r], False)
            if r in self.statuses else
            multinode.RankEnd(self.options.rank_offset + r,
                              -1 if p.returncode is None else exit_status(p.returncode), True)
            for r, p in enumerate(self.procs))
        return Outcome(status, reason, restartable, when, ranks)

    def _error(self, rank: int) -> str:
        """``: <its exception line>`` for a rank that has exited, once its output is read."""
        deadline = time.monotonic() + 2.0  # its group is killed: EOF comes at once, unless held
        for t in self.pumps[rank]:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        line = self.errors[rank].line
        return f" ({line})" if line else ""

    def _reap(self, now: float) -> Outcome | None:
        for rank in sorted(self.running):
            rc = self.procs[rank].poll()
            if rc is None:
                continue
            when = time.time()
            self.running.discard(rank)
            # The rank is done: whatever it left behind in its group goes with it.
            signal_groups([self.procs[rank]], signal.SIGKILL)
            self.guardian.remove(self.procs[rank].pid)
            status = self.statuses[rank] = exit_status(rc)
            name = self.label(self.options.rank_offset + rank)
            if status == 0:
                self.exited_ok.add(rank)
            elif status == EXIT_RESUME:
                self.resumable.add(rank)
                if self.preempt_deadline is None:
                    note(f"{name} saved a checkpoint and asks to be resumed "
                         f"({describe(status)}); waiting up to "
                         f"{self.options.preemption_grace_s:g} s for the others")
                    self.preempt_deadline = now + self.options.preemption_grace_s
            else:
                return self.end(status, f"{name} exited with {describe(status)}"
                                f"{self._error(rank)}", True, when)
        if self.running:
            return None
        if isinstance(self.peer, multinode.Worker):
            self._forward_progress()  # the last states (exited), before the attempt's end
        if self.resumable:
            reason = (f"job preempted: rank(s) {_ranks(self.options, self.resumable)} "
                      f"saved a checkpoint and exited with {describe(EXIT_RESUME)}")
            return self._outcome(EXIT_RESUME, reason, not self.launcher_preempted, time.time())
        return self._outcome(0, "", False, 0.0)

    def _obey_signals(self, now: float) -> Outcome | None:
        while self.handled_signals < len(self.signals):
            sig = self.signals[self.handled_signals]
            self.handled_signals += 1
            if sig != signal.SIGTERM or self.handled_signals != 1:
                return self.end(128 + sig, f"got {signal.Signals(sig).name}", False)
            # Preemption: each rank finishes its step, saves, and exits with EXIT_RESUME.
            # Only the rank itself gets it: its children (data loaders) must live to the end.
            grace = self.options.preemption_grace_s
            note(f"got SIGTERM: passing it to every rank (preemption: save and exit with "
                 f"{EXIT_RESUME}); waiting up to {grace:g} s")
            for r in sorted(self.running):
                try:
                    self.procs[r].send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            self.launcher_preempted = True
            self.preempt_deadline = now + grace
        return None

    def _timeout(self, now: float) -> Outcome | None:
        o = self.options
        if o.deadline is not None and now > o.deadline:
            return self.end(EXIT_TIMEOUT, f"timed out after {o.timeout_s:g} s", False)
        return None

    def _follow_peer(self, now: float) -> Outcome | None:
        order = self.peer.poll() if self.peer is not None else None
        if order is not None and order.status == EXIT_RESUME and self.preempt_deadline is None:
            # Preempted elsewhere: this node's ranks reach the same sync point and save too.
            note(f"{order.reason}; waiting up to {self.options.preemption_grace_s:g} s for "
                 "this node's ranks to save")
            self.preempt_deadline = now + self.options.preemption_grace_s
        elif order is not None and order.status != EXIT_RESUME:
            return self.end(order.status, order.reason, order.restartable, order.time)
        return None

    def _preemption_over(self, now: float) -> Outcome | None:
        assert self.preempt_deadline is not None
        if now <= self.preempt_deadline:
            return None
        status = EXIT_RESUME if self.resumable else 128 + signal.SIGTERM
        return self.end(status, f"rank(s) {_ranks(self.options, self.running)} did not exit "
                        f"within {self.options.preemption_grace_s:g} s of the preemption",
                        not self.launcher_preempted)

    def _view(self) -> tuple[dict[int, RankProgress], float, bool, set[int], set[int]]:
        """Every rank's progress this agent knows (by global rank; with the master, every
        node's), when one last completed a step, whether one did, the exited and running ones."""
        local, last_progress, any_completed = self.links.snapshot()
        offset = self.options.rank_offset
        progress = {offset + r: p for r, p in enumerate(local)}
        exited_ok = {offset + r for r in self.exited_ok}
        running = {offset + r for r in self.running}
        if isinstance(self.peer, multinode.Master):
            remote, remote_last = self.peer.remote_progress()
            for rank, p in remote.items():
                progress[rank] = RankProgress(p.completed, p.dispatched, p.state == "e")
                (exited_ok if p.state == "0" else running).add(rank)
                any_completed = any_completed or p.completed >= 0
            last_progress = max(last_progress, remote_last)
        return progress, last_progress, any_completed, exited_ok, running

    def _forward_progress(self) -> None:
        assert isinstance(self.peer, multinode.Worker)
        local, _, _ = self.links.snapshot()
        self.peer.report_progress({
            self.options.rank_offset + r: multinode.RankProgress(
                p.completed, p.dispatched,
                "0" if r in self.exited_ok else "e" if p.exiting else "r")
            for r, p in enumerate(local) if r in self.running or r in self.exited_ok})

    def _check_progress(self, now: float) -> Outcome | None:
        progress, last_progress, any_completed, exited_ok, running = self._view()
        early = _early_exit(progress, exited_ok, running, self.label)
        if early is not None:
            return self.end(EXIT_EARLY, early, True)
        if isinstance(self.peer, multinode.Worker):
            return None  # node 0's agent runs the watchdog over every node's ranks
        o = self.options
        limit = o.step_timeout_s if any_completed else o.first_step_timeout_s
        finishing = bool(exited_ok) or any(progress[r].exiting for r in running)
        if limit is None or finishing or now - last_progress <= limit:
            return None
        which = "--step-timeout" if any_completed else "--first-step-timeout"
        what = "completed a step" if any_completed else "completed its first step"
        return self.end(EXIT_STUCK, f"watchdog: no rank {what} for {now - last_progress:.1f} s "
                        f"({which} {limit:g}): "
                        f"{_progress_lines(progress, sorted(progress), self.label)}", True)


def _ranks(options: Options, local: set[int]) -> str:
    """The global ranks of this node's ranks ``local``, for messages."""
    return ", ".join(str(options.rank_offset + r) for r in sorted(local))
