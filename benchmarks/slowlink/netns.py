"""A real slow link on one machine: two network namespaces joined by a shaped veth pair.

    with SlowLink() as link:                      # root only; one at a time (a lock file)
        link.shape("300mbit")                     # tbf on both ends; None: unshaped
        p = link.run(0, ["python", "-c", "..."])  # a process inside namespace 0
        link.tx_bytes(0)                          # bytes namespace 0 sent over the veth

What it makes, all named after this process's id (``jddpsl<pid>a``/``b`` namespaces, ``jsl<pid>a``/
``b`` veth ends, ``/etc/netns/<ns>/hosts``), and nothing else: two namespaces, each with its
loopback up and one veth end holding ``10.213.0.1/24`` or ``10.213.0.2/24`` (addresses that exist
only inside them). ``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``,
which maps this machine's host name to the namespace's address: JAX gives Gloo no interface, and
Gloo binds what the host name resolves to (the loopback otherwise, unreachable from the other
namespace). Shaping: ``tc qdisc replace dev <end> root tbf rate R burst B latency 50ms`` on both
ends, burst about 4 ms of the rate and at least 128 KiB (``netem`` is not in every kernel: this
is bandwidth only, no propagation delay).

Clean-up, on exit however it comes (exception, SIGTERM, SIGINT, atexit): every process started
with :meth:`SlowLink.run` and anything else still inside the two namespaces is ended by PID
(SIGTERM to its process group, SIGKILL after a grace), the namespaces are deleted (which deletes
the veth pair), and the hosts files are removed. Namespaces left by an earlier run of this
harness whose process is gone (killed with SIGKILL) are removed at start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence

LOCK_PATH = "/tmp/jddp-slowlink.lock"
PREFIX = "jddpsl"
ADDRESSES = ("10.213.0.1", "10.213.0.2")


class HarnessUnavailable(RuntimeError):
    """This machine or user cannot make the link (not root, no ``ip netns``, no ``tc``)."""


def check_available() -> None:
    """Raises :class:`HarnessUnavailable` with what is missing and how to get it."""
    if os.geteuid() != 0:
        raise HarnessUnavailable(
            "the slow-link harness needs root (it creates network namespaces, a veth pair and tc "
            "qdiscs): run it as root, e.g. `sudo -E python benchmarks/slowlink/bench.py`")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise HarnessUnavailable(f"the slow-link harness needs `{tool}` (iproute2): "
                                     "apt-get install iproute2")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise HarnessUnavailable(f"`ip netns` does not work here: {probe.stderr.strip()}")
    _probe()


def _probe() -> None:
    """Makes and removes a namespace holding a veth pair shaped by tbf: a container without the
    capabilities, or a kernel without veth or tbf, fails here and not halfway through a run."""
    name, dev = f"{PREFIX}{os.getpid()}p", f"jsl{os.getpid()}p"
    steps = [("netns", "add", name),
             ("-n", name, "link", "add", dev, "type", "veth", "peer", "name", dev + "q"),
             ("netns", "exec", name, *shape_command(dev, "1gbit"))]
    try:
        for step in steps:
            out = _ip(*step, check=False)
            if out.returncode != 0:
                raise HarnessUnavailable(
                    f"cannot make the slow link here (`ip {' '.join(step)}`: "
                    f"{out.stderr.strip()}): it needs network namespaces, veth and tc's tbf")
    finally:
        _ip("netns", "del", name, check=False)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tbf_burst(rate_bits: float) -> int:
    """tbf's bucket in bytes: about 4 ms of the rate, at least 128 KiB."""
    return max(int(rate_bits / 8 * 0.004), 128 * 1024)


def parse_rate(rate: str) -> float:
    """``"300mbit"`` -> 3e8 bits/s (tc's units: kbit, mbit, gbit)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"rate must look like 300mbit or 1gbit, got {rate!r}")


def _leftovers() -> list[str]:
    """Namespaces of this harness whose creating process is gone."""
    names = [ln.split()[0] for ln in _ip("netns", "list").stdout.splitlines() if ln.strip()]
    stale = []
    for name in names:
        pid = name[len(PREFIX):-1]
        if name.startswith(PREFIX) and pid.isdigit() and not _pid_alive(int(pid)):
            stale.append(name)
    return stale


@contextlib.contextmanager
def _lock(timeout_s: float) -> Iterator[None]:
    """Never two harness runs at once on this machine (an flock on ``LOCK_PATH``)."""
    with open(LOCK_PATH, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another slow-link run holds {LOCK_PATH} since more than "
                                       f"{timeout_s:g} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class SlowLink:
    """Two namespaces joined by a veth pair; see the module docstring."""

    def __init__(self, lock_timeout_s: float = 600.0, map_hostname: bool = True) -> None:
        """Args:
          lock_timeout_s: how long to wait for another run of the harness to finish.
          map_hostname: write ``/etc/netns/<ns>/hosts`` (host name -> namespace address); off,
            the namespaces see this machine's ``/etc/hosts`` (to test jddp's Gloo options).
        """
        self.lock_timeout_s = lock_timeout_s
        self.map_hostname = map_hostname
        tag = f"{os.getpid()}"
        self.namespaces = (f"{PREFIX}{tag}a", f"{PREFIX}{tag}b")
        self.devices = (f"jsl{tag}a", f"jsl{tag}b")
        self.addresses = ADDRESSES
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces created, for clean-up
        self._made_etc_netns = False
        self._stack = contextlib.ExitStack()
        self._old_handlers: dict[int, object] = {}

    # ------------------------------------------------------------------- set-up and clean-up

    def __enter__(self) -> SlowLink:
        check_available()
        self._stack.enter_context(_lock(self.lock_timeout_s))
        self._stack.callback(self.close)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            for stale in _leftovers():
                _remove_namespace(stale)
            self._create()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _on_signal(self, signum, frame):
        raise SystemExit(128 + signum)  # unwinds through __exit__: everything is removed

    def _create(self) -> None:
        ns, dev = self.namespaces, self.devices
        for name in ns:
            _ip("netns", "add", name)
            self._made.append(name)
        _ip("link", "add", dev[0], "netns", ns[0], "type", "veth", "peer", "name", dev[1],
            "netns", ns[1])
        host = socket.gethostname()
        if self.map_hostname and not os.path.isdir("/etc/netns"):
            os.makedirs("/etc/netns")
            self._made_etc_netns = True
        for name, d, addr in zip(ns, dev, self.addresses, strict=True):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", d)
            _ip("-n", name, "link", "set", d, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            if self.map_hostname:
                os.makedirs(f"/etc/netns/{name}", exist_ok=True)
                with open(f"/etc/netns/{name}/hosts", "w") as f:
                    f.write(f"127.0.0.1\tlocalhost\n{addr}\t{host}\n")

    def close(self) -> None:
        """Ends every process inside the namespaces (by PID) and removes what was made."""
        self.end_processes()
        for name in self._made:
            _remove_namespace(name)
        self._made = []
        if self._made_etc_netns:
            with contextlib.suppress(OSError):
                os.rmdir("/etc/netns")  # only if empty: another tool's entries stay
            self._made_etc_netns = False
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers = {}

    def end_processes(self, grace_s: float = 5.0) -> None:
        """SIGTERM to each started process group, SIGKILL after ``grace_s``; then SIGKILL to any
        process still inside the namespaces (``ip netns pids``: only ours can be there)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for name in self._made:
            _kill_inside(name)
        self.procs = []

    # ------------------------------------------------------------------------------ use

    def shape(self, rate: str | None) -> None:
        """tbf at ``rate`` (e.g. ``"300mbit"``) on both veth ends; ``None`` removes it."""
        for name, dev in zip(self.namespaces, self.devices, strict=True):
            # Removing a shaping that is not there fails harmlessly.
            _ip("netns", "exec", name, *shape_command(dev, rate), check=rate is not None)

    def tx_bytes(self, side: int) -> int:
        """Bytes sent so far from namespace ``side`` over its veth end."""
        out = _ip("-n", self.namespaces[side], "-j", "-s", "link", "show", "dev",
                  self.devices[side]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def run(self, side: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            **popen_kw) -> subprocess.Popen:
        """Starts ``argv`` inside namespace ``side`` (its own process group; tracked)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[side], *argv],
                             env=None if env is None else dict(env), start_new_session=True,
                             **popen_kw)
        self.procs.append(p)
        return p


def shape_command(dev: str, rate: str | None) -> list[str]:
    """The ``tc`` command that shapes ``dev`` to ``rate`` (``None``: remove the shaping)."""
    if rate is None:
        return ["tc", "qdisc", "del", "dev", dev, "root"]
    burst = tbf_burst(parse_rate(rate))
    return ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
            str(burst), "latency", "50ms"]


def _kill_inside(name: str) -> None:
    out = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in out:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove_namespace(name: str) -> None:
    """Deletes namespace ``name`` (its veth end with it: the pair goes) and its hosts file."""
    _kill_inside(name)
    _ip("netns", "del", name, check=False)
    shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
