"""The channel between the `jddp-run` agents of a multi-node job (one agent per node).

Node 0's agent (the *master*) decides, runs the watchdog and the early-exit rule over every
node's ranks; the others (the *workers*) obey and report, over a TCP connection of their own at
``HOST:PORT+1`` (the ranks, and the coordinator with them, may all be dead when the agents must
agree). The protocol's lines and the status rules: docs/cluster.md, "jddp-run on several nodes".
"""

from __future__ import annotations

import select
import socket
import time
from typing import NamedTuple

from jddp._src.runtime import watchdog

__all__ = ["AttemptEnd", "Master", "RankEnd", "RankProgress", "Worker", "channel_address",
           "earliest_failure"]

_POLL_S = 0.05


class RankEnd(NamedTuple):
    """How one rank ended: its global rank, its exit status, and whether jddp-run ended it."""

    rank: int
    status: int
    ended: bool = False


class RankProgress(NamedTuple):
    """A rank's progress as its agent saw it (``state``: ``r`` running, ``e`` announced its exit,
    ``0`` exited with status 0)."""

    completed: int
    dispatched: int
    state: str


class AttemptEnd(NamedTuple):
    """How an attempt ended (on one node), or an order to end it.

    Attributes:
      restartable: the job may be run again (``--max-restarts``).
      signalled: the agent itself got a signal (Ctrl-C, SIGTERM): never restart then.
      time: when the cause was seen (Unix time; 0: never, a success), which orders failures.
    """

    status: int
    reason: str
    restartable: bool
    signalled: bool = False
    time: float = 0.0
    ranks: tuple[RankEnd, ...] = ()


def channel_address(master_addr: str) -> tuple[str, int]:
    """``(host, port + 1)`` for ``master_addr = "host:port"``: where node 0's agent listens."""
    host, sep, port = master_addr.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(
            f"--master-addr must be HOST:PORT with a port in 1-65534 (the agents also use "
            f"PORT+1), got {master_addr!r}: give node 0's address and a free port, e.g. "
            "10.0.0.1:29500")
    return host.strip("[]"), int(port) + 1


def _end_line(kind: str, attempt: int, end: AttemptEnd) -> str:
    reason = " ".join(end.reason.split()) or "-"
    if kind == "end":
        return f"end {attempt} {end.status} {int(end.restartable)} {end.time!r} {reason}"
    ranks = ",".join(f"{r.rank}:{r.status}:{'e' if r.ended else 'x'}" for r in end.ranks) or "-"
    return (f"ended {attempt} {end.status} {int(end.restartable)} {int(end.signalled)} "
            f"{end.time!r} {ranks} {reason}")


def _parse_ranks(text: str) -> tuple[RankEnd, ...]:
    if text == "-":
        return ()
    ends = []
    for item in text.split(","):
        rank, status, how = item.split(":")
        ends.append(RankEnd(int(rank), int(status), how == "e"))
    return tuple(ends)


def _parse_end(parts: list[str], with_signal: bool) -> tuple[int, AttemptEnd]:
    """``(attempt, AttemptEnd)`` of an ``end`` (``with_signal=False``) or ``ended`` line."""
    attempt, status, restartable = int(parts[1]), int(parts[2]), parts[3] == "1"
    if not with_signal:
        return attempt, AttemptEnd(status, " ".join(parts[5:]), restartable,
                                   time=float(parts[4]))
    return attempt, AttemptEnd(status, " ".join(parts[7:]), restartable, parts[4] == "1",
                               float(parts[5]), _parse_ranks(parts[6]))


def earliest_failure(ends: list[AttemptEnd]) -> AttemptEnd:
    """The end that decides the job: the first failure in time (the cause; ranks that failed
    because of it fail later), else the first end (all succeeded)."""
    failures = [e for e in ends if e.status != 0]
    return min(failures, key=lambda e: e.time) if failures else ends[0]


class Master:
    """Node 0's side: waits for every other node, then starts, ends and decides attempts."""

    def __init__(self, master_addr: str, nnodes: int, timeout_s: float) -> None:
        host, port = channel_address(master_addr)
        self.nnodes = nnodes
        self.server = socket.create_server((host, port), reuse_port=False)
        self.links: dict[int, watchdog.Lines] = {}
        self.ended: dict[int, AttemptEnd] = {}
        self.attempt = -1
        self.progress: dict[int, RankProgress] = {}  # the other nodes' ranks, by global rank
        self.last_progress = time.monotonic()  # when another node's rank last completed a step
        deadline = time.monotonic() + timeout_s
        pending: list[watchdog.Lines] = []
        while len(self.links) < nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, nnodes)) - set(self.links))
                self.close()
                raise TimeoutError(
                    f"node(s) {missing} did not join within {timeout_s:g} s at {host}:{port} "
                    "(the master address + 1): start jddp-run with the same --nnodes and "
                    "--master-addr on every node, and check that this port is reachable")
            ready, _, _ = select.select([self.server], [], [], min(left, 0.2))
            if ready:
                conn, _ = self.server.accept()
                pending.append(watchdog.Lines(conn))
            for link in list(pending):
                for line in link.read() or []:
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == "hello" and parts[1].isdigit():
                        node = int(parts[1])
                        if not 0 < node < nnodes or node in self.links:
                            link.send(f"finish 2 node rank {node} is invalid or taken")
                            link.close()
                        else:
                            self.links[node] = link
                        pending.remove(link)
                        break

    def start(self, attempt: int) -> None:
        """Starts attempt ``attempt`` on every other node."""
        self.attempt, self.ended, self.progress = attempt, {}, {}
        self.last_progress = time.monotonic()
        for link in self.links.values():
            link.send(f"start {attempt}")

    def _receive(self) -> None:
        for node, link in self.links.items():
            if node in self.ended:
                continue
            lines = link.read()
            if lines is None:
                self.ended[node] = AttemptEnd(1, f"lost the agent of node {node}", False,
                                              time=time.time())
                continue
            for line in lines:
                parts = line.split()
                if len(parts) >= 7 and parts[0] == "ended" and int(parts[1]) == self.attempt:
                    self.ended[node] = _parse_end(parts, with_signal=True)[1]
                elif len(parts) == 6 and parts[0] == "progress" and int(parts[1]) == self.attempt:
                    self._note_progress(int(parts[2]), RankProgress(int(parts[3]), int(parts[4]),
                                                                    parts[5]))

    def _note_progress(self, rank: int, progress: RankProgress) -> None:
        old = self.progress.get(rank)
        if old is None or progress.completed > old.completed:
            if progress.completed >= 0:
                self.last_progress = time.monotonic()
        self.progress[rank] = progress

    def remote_progress(self) -> tuple[dict[int, RankProgress], float]:
        """The other nodes' ranks' progress (by global rank), and when one last completed a step
        (``time.monotonic``; the attempt's start before any did)."""
        self._receive()
        return dict(self.progress), self.last_progress

    def poll(self) -> AttemptEnd | None:
        """An order for this node's ranks: the first other node whose attempt ended badly."""
        self._receive()
        failed = [e for _, e in sorted(self.ended.items()) if e.status != 0]
        return earliest_failure(failed) if failed else None

    def finish_attempt(self, mine: AttemptEnd) -> AttemptEnd:
        """Ends the attempt everywhere and waits for every node; returns the job's outcome."""
        if mine.status != 0:
            for node, link in self.links.items():
                if node not in self.ended:
                    link.send(_end_line("end", self.attempt, mine))
        while len(self.ended) < len(self.links):
            self._receive()
            if self.poll() is not None and mine.status == 0:
                # Another node failed after this one's ranks finished: end the rest too.
                mine = self.poll()  # type: ignore[assignment]
                for node, link in self.links.items():
                    if node not in self.ended:
                        link.send(_end_line("end", self.attempt, mine))
            time.sleep(_POLL_S)
        ends = [mine, *(self.ended[n] for n in sorted(self.ended))]
        first = earliest_failure(ends)
        ranks = tuple(sorted((r for e in ends for r in e.ranks), key=lambda r: r.rank))
        return first._replace(restartable=first.restartable and not any(e.signalled for e in ends),
                              signalled=any(e.signalled for e in ends), ranks=ranks)

    def finish(self, status: int, reason: str = "") -> None:
        """No more attempts: every node exits with ``status`` (``reason``: why, for messages)."""
        for link in self.links.values():
            link.send(f"finish {status} {' '.join(reason.split())}".rstrip())

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.server.close()


class Worker:
    """A node other than 0: joins the master, runs the attempts it orders, reports how each ended."""

    def __init__(self, master_addr: str, node_rank: int, timeout_s: float) -> None:
        host, port = channel_address(master_addr)
        deadline = time.monotonic() + timeout_s
        last: OSError | None = None
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=2.0)
                break
            except OSError as e:
                last = e
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"could not reach node 0's jddp-run at {host}:{port} (the master address "
                        f"+ 1) within {timeout_s:g} s: {last}. Start node 0 with the same "
                        "--master-addr, and check that the port is reachable from here") from None
                time.sleep(0.2)
        sock.settimeout(None)
        self.link = watchdog.Lines(sock)
        self.link.send(f"hello {node_rank}")
        self.attempt = -1
        self.pending: list[str] = []
        self.sent: dict[int, RankProgress] = {}  # progress sent this attempt, by global rank

    def next_command(self) -> tuple[str, int, str]:
        """Blocks for ``("start", attempt, "")`` or ``("finish", status, reason)`` from the
        master."""
        while True:
            while self.pending:
                parts = self.pending.pop(0).split()
                if len(parts) >= 2 and parts[0] == "start":
                    self.attempt, self.sent = int(parts[1]), {}
                    return "start", self.attempt, ""
                if len(parts) >= 2 and parts[0] == "finish":
                    return "finish", int(parts[1]), " ".join(parts[2:])
            lines = self.link.read(timeout=0.5)
            if lines is None:  # the master is gone: nothing more to run
                return "finish", 1, "lost node 0's jddp-run"
            self.pending.extend(lines)

    def report_progress(self, progress: dict[int, RankProgress]) -> None:
        """Sends the master the ranks' progress that changed since the last call."""
        for rank, p in sorted(progress.items()):
            if self.sent.get(rank) != p:
                self.sent[rank] = p
                self.link.send(f"progress {self.attempt} {rank} {p.completed} {p.dispatched} "
                               f"{p.state}")

    def poll(self) -> AttemptEnd | None:
        """An order to end this attempt's ranks, if the master sent one."""
        lines = self.link.read()
        if lines is None:
            return AttemptEnd(1, "lost node 0's jddp-run", False, time=time.time())
        self.pending.extend(lines)
        for i, line in enumerate(self.pending):
            parts = line.split()
            if len(parts) >= 5 and parts[0] == "end" and int(parts[1]) == self.attempt:
                del self.pending[i]
                return _parse_end(parts, with_signal=False)[1]
        return None

    def finish_attempt(self, mine: AttemptEnd) -> AttemptEnd:
        """Reports how this node's attempt ended."""
        self.link.send(_end_line("ended", self.attempt, mine))
        return mine

    def close(self) -> None:
        self.link.close()
