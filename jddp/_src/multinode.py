"""The channel between the `jddp-run` agents of a multi-node job (one agent per node).

    node 0:  jddp-run --nnodes 2 --node-rank 0 --master-addr HOST:PORT -n 4 train.py
    node 1:  jddp-run --nnodes 2 --node-rank 1 --master-addr HOST:PORT -n 4 train.py

The JAX coordinator of the job runs in global rank 0 (on node 0) at ``HOST:PORT``. The agents talk
over a TCP connection of their own to node 0's agent at ``HOST:PORT+1``: the ranks may all be
dead (and the coordinator with them) when the agents must agree on what happens next. Node 0's
agent (the *master*) decides; the others (the *workers*) obey and report. Newline-terminated
text lines:

====================================  =============  ========================================
line                                  direction      meaning
====================================  =============  ========================================
``hello NODE``                        worker→master  node ``NODE`` joined (once, at start)
``start ATTEMPT``                     master→worker  start your ranks for attempt ``ATTEMPT``
``end ATTEMPT STATUS R REASON``       master→worker  end your ranks: the job ends with STATUS
                                                     (``R``: 1 if it may restart)
``ended ATTEMPT STATUS R S REASON``   worker→master  my ranks are gone: how (``S``: 1 if the
                                                     agent itself got a signal)
``finish STATUS``                     master→worker  no more attempts: exit with STATUS
====================================  =============  ========================================

A rank that fails, hangs (the agent's watchdog) or exits for a preemption on any node ends its
agent's attempt; that agent reports ``ended``, the master orders every other node to ``end``,
and when all have reported it either starts the next attempt everywhere (``--max-restarts``) or
sends ``finish``. An ``end`` with status ``EXIT_RESUME`` (a preemption) gives the local ranks the
preemption grace to save first: JAX's preemption sync point has them exit at the same step. A
lost connection ends the job on the nodes that remain (not restartable: a node is gone).
"""

from __future__ import annotations

import select
import socket
import time
from typing import NamedTuple

__all__ = ["AttemptEnd", "Master", "Worker", "channel_address"]

_POLL_S = 0.05


class AttemptEnd(NamedTuple):
    """How an attempt ended (on one node), or an order to end it.

    Attributes:
      status: the exit status.
      reason: why, for messages.
      restartable: the job may be run again (``--max-restarts``).
      signalled: the agent itself got a signal (Ctrl-C, SIGTERM): never restart then.
    """

    status: int
    reason: str
    restartable: bool
    signalled: bool = False


def channel_address(master_addr: str) -> tuple[str, int]:
    """``(host, port + 1)`` for ``master_addr = "host:port"``: where node 0's agent listens."""
    host, sep, port = master_addr.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(
            f"--master-addr must be HOST:PORT with a port in 1-65534 (the agents also use "
            f"PORT+1), got {master_addr!r}: give node 0's address and a free port, e.g. "
            "10.0.0.1:29500")
    return host.strip("[]"), int(port) + 1


class _Lines:
    """A socket read as text lines without blocking (``None`` once it is closed)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.closed = False

    def send(self, line: str) -> None:
        try:
            self.sock.sendall(line.encode() + b"\n")
        except OSError:
            self.closed = True

    def read(self, timeout: float = 0.0) -> list[str] | None:
        """The complete lines available within ``timeout``; ``None`` if the peer is gone."""
        if self.closed:
            return None
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if ready:
                data = self.sock.recv(65536)
                if not data:
                    self.closed = True
                    return None
                self.buffer += data
        except OSError:
            self.closed = True
            return None
        *lines, self.buffer = self.buffer.split(b"\n")
        return [ln.decode(errors="replace") for ln in lines]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _end_line(kind: str, attempt: int, end: AttemptEnd) -> str:
    extra = f" {int(end.signalled)}" if kind == "ended" else ""
    reason = " ".join(end.reason.split()) or "-"
    return f"{kind} {attempt} {end.status} {int(end.restartable)}{extra} {reason}"


def _parse_end(parts: list[str], with_signal: bool) -> tuple[int, AttemptEnd]:
    attempt, status, restartable = int(parts[1]), int(parts[2]), parts[3] == "1"
    signalled = with_signal and parts[4] == "1"
    reason = " ".join(parts[5 if with_signal else 4:])
    return attempt, AttemptEnd(status, reason, restartable, signalled)


class Master:
    """Node 0's side: waits for every other node, then starts, ends and decides attempts."""

    def __init__(self, master_addr: str, nnodes: int, timeout_s: float) -> None:
        host, port = channel_address(master_addr)
        self.nnodes = nnodes
        self.server = socket.create_server((host, port), reuse_port=False)
        self.links: dict[int, _Lines] = {}
        self.ended: dict[int, AttemptEnd] = {}
        self.attempt = -1
        deadline = time.monotonic() + timeout_s
        pending: list[_Lines] = []
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
                pending.append(_Lines(conn))
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
        self.attempt, self.ended = attempt, {}
        for link in self.links.values():
            link.send(f"start {attempt}")

    def _receive(self) -> None:
        for node, link in self.links.items():
            if node in self.ended:
                continue
            lines = link.read()
            if lines is None:
                self.ended[node] = AttemptEnd(1, f"lost the agent of node {node}", False)
                continue
            for line in lines:
                parts = line.split()
                if len(parts) >= 5 and parts[0] == "ended" and int(parts[1]) == self.attempt:
                    self.ended[node] = _parse_end(parts, with_signal=True)[1]

    def poll(self) -> AttemptEnd | None:
        """An order for this node's ranks: the first other node whose attempt ended badly."""
        self._receive()
        for node, end in sorted(self.ended.items()):
            if end.status != 0:
                return end._replace(reason=f"node {node}: {end.reason}")
        return None

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
        first = next((e for e in ends if e.status != 0), mine)
        return first._replace(restartable=first.restartable and not any(e.signalled for e in ends),
                              signalled=any(e.signalled for e in ends))

    def finish(self, status: int) -> None:
        """No more attempts: every node exits with ``status``."""
        for link in self.links.values():
            link.send(f"finish {status}")

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
        self.link = _Lines(sock)
        self.link.send(f"hello {node_rank}")
        self.attempt = -1
        self.pending: list[str] = []

    def next_command(self) -> tuple[str, int]:
        """Blocks for ``("start", attempt)`` or ``("finish", status)`` from the master."""
        while True:
            while self.pending:
                parts = self.pending.pop(0).split()
                if len(parts) >= 2 and parts[0] == "start":
                    self.attempt = int(parts[1])
                    return "start", self.attempt
                if len(parts) >= 2 and parts[0] == "finish":
                    return "finish", int(parts[1])
            lines = self.link.read(timeout=0.5)
            if lines is None:
                return "finish", 1  # the master is gone: nothing more to run
            self.pending.extend(lines)

    def poll(self) -> AttemptEnd | None:
        """An order to end this attempt's ranks, if the master sent one."""
        lines = self.link.read()
        if lines is None:
            return AttemptEnd(1, "lost node 0's jddp-run", False)
        self.pending.extend(lines)
        for i, line in enumerate(self.pending):
            parts = line.split()
            if len(parts) >= 4 and parts[0] == "end" and int(parts[1]) == self.attempt:
                del self.pending[i]
                return _parse_end(parts, with_signal=False)[1]
        return None

    def finish_attempt(self, mine: AttemptEnd) -> AttemptEnd:
        """Reports how this node's attempt ended."""
        self.link.send(_end_line("ended", self.attempt, mine))
        return mine

    def close(self) -> None:
        self.link.close()
