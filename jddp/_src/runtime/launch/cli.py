"""`jddp-run`'s command line: its parser (every token from the script on is the script's) and
`main`, which starts one job (`agent.launch`) or islands (`islands.launch_islands`)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any

from jddp._src.runtime import multinode
from jddp._src.runtime.coordinator import EXIT_RESUME
from jddp._src.runtime.launch.agent import launch
from jddp._src.runtime.launch.procs import EXIT_EARLY, EXIT_PORT_IN_USE, EXIT_STUCK, EXIT_TIMEOUT


def _number(kind: type, minimum: float, *, strict: bool, fix: str) -> Any:
    """An argparse ``type=`` that parses ``kind`` and rejects values below ``minimum`` (or equal,
    with ``strict``) as a usage error naming the bound and ``fix``."""
    bound = f"{'>' if strict else '>='} {minimum:g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not (value > minimum if strict else value >= minimum):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}; {fix}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def _port(text: str) -> int:
    """An argparse ``type=`` for a TCP port (1-65535)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(
            f"must be a TCP port in 1-65535, got {text}; leave --port out to get a free one")
    return port


def _master_addr(text: str) -> str:
    """An argparse ``type=`` for ``HOST:PORT`` (PORT + 1 must be a port too: the agents' channel)."""
    try:
        multinode.channel_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _quorum_addr(text: str) -> str:
    """An argparse ``type=`` for ``--quorum HOST:PORT`` (torchft's Lighthouse)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(
            f"must be HOST:PORT (torchft's Lighthouse, e.g. 127.0.0.1:29510), got {text!r}")
    _port(port)
    return text


class Parser(argparse.ArgumentParser):
    """jddp-run's parser: every token from the script on belongs to the script.

    argparse alone reads options anywhere on the line and expands abbreviations, so
    ``jddp-run train.py --n=20`` failed as an ambiguous launcher option (``--nprocs`` or
    ``--no-prefix``). :meth:`split` cuts the line at the script first.
    """

    def __init__(self, **kwargs: object) -> None:
        self.flags: set[str] = set()  # option strings that take no value
        self.valued: set[str] = set()  # option strings followed by a value
        super().__init__(**kwargs)  # type: ignore[arg-type]  # (adds -h, hence set first)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        (self.valued if action.nargs != 0 else self.flags).update(action.option_strings)
        return action

    def _takes_value(self, token: str) -> bool:
        """Whether launcher option ``token`` (without ``=value``) is followed by its value;
        unique prefixes count as the option (argparse's abbreviations)."""
        if token in self.valued or token in self.flags:
            return token in self.valued
        if not token.startswith("--"):
            return token[:2] in self.valued and len(token) == 2
        matches = [o for o in self.valued | self.flags if o.startswith(token)]
        return len(matches) == 1 and matches[0] in self.valued

    def split(self, argv: Sequence[str]) -> tuple[list[str], list[str]]:
        """``(launcher tokens up to and including the script, the script's own arguments)``."""
        argv = list(argv)
        i = 0
        while i < len(argv):
            token = argv[i]
            if token == "--":
                return argv[:i] + argv[i + 1:i + 2], argv[i + 2:]
            if token.startswith("-") and token != "-":
                i += 2 if "=" not in token and self._takes_value(token) else 1
                continue
            return argv[:i + 1], argv[i + 1:]
        return argv, []


def parser() -> Parser:
    ap = Parser(
        prog="jddp-run",
        description="Run a script as N local processes of one multi-process JAX job.",
        epilog=f"Exit status: 0; the first failing rank's status; {EXIT_RESUME} preempted, "
               f"resume from the checkpoint; {EXIT_STUCK} watchdog (stuck); {EXIT_EARLY} a rank "
               f"left early; {EXIT_TIMEOUT} --timeout; {EXIT_PORT_IN_USE} --port in use; 128+N "
               "signal N. See docs/faults.md.",
    )
    ap.add_argument("-n", "--nprocs", default=1,
                    type=_number(int, 1, strict=False, fix="give the number of processes to run"),
                    help="number of processes (ranks)")
    ap.add_argument("--devices-per-process", default=None,
                    type=_number(int, 1, strict=False,
                                 fix="leave it out to use the platform's devices"),
                    help="simulated CPU devices per process (JDDP_LOCAL_DEVICE_COUNT)")
    ap.add_argument("--grace", default=5.0,
                    type=_number(float, 0, strict=False, fix="0 sends SIGKILL at once"),
                    help="seconds between SIGTERM and SIGKILL when ending ranks (default 5)")
    ap.add_argument("--timeout", default=None,
                    type=_number(float, 0, strict=True, fix="leave it out for no limit"),
                    help="end the whole job, restarts included, after this many seconds "
                         f"(exit status {EXIT_TIMEOUT})")
    ap.add_argument("--step-timeout", default=None, metavar="SECONDS",
                    type=_number(float, 0, strict=True,
                                 fix="leave it out to turn the watchdog off"),
                    help="watchdog: end the job when no rank completes a training step for this "
                         f"long (exit status {EXIT_STUCK}; default: off)")
    ap.add_argument("--first-step-timeout", default=None, metavar="SECONDS",
                    type=_number(float, 0, strict=True,
                                 fix="leave it out for 10 x --step-timeout"),
                    help="the same limit until the first step completes (start-up, compilation; "
                         "default 10 x --step-timeout, at least 60)")
    ap.add_argument("--max-restarts", default=0, metavar="N",
                    type=_number(int, 0, strict=False, fix="0 never restarts"),
                    help="run the whole job again after a failure or preemption, up to N times "
                         "(default 0)")
    ap.add_argument("--preemption-grace", default=30.0, metavar="SECONDS",
                    type=_number(float, 0, strict=False, fix="the default is 30"),
                    help="after a preemption (SIGTERM), how long ranks get to save and exit "
                         "(default 30)")
    ap.add_argument("--port", type=_port, default=None,
                    help="coordinator port on 127.0.0.1 (default: a free port)")
    ap.add_argument("--nnodes", default=1,
                    type=_number(int, 1, strict=False, fix="1 is a one-node job"),
                    help="number of nodes; run jddp-run on each (default 1)")
    ap.add_argument("--node-rank", default=0,
                    type=_number(int, 0, strict=False, fix="nodes count from 0"),
                    help="this node's index in [0, --nnodes) (default 0)")
    ap.add_argument("--master-addr", type=_master_addr, default=None, metavar="HOST:PORT",
                    help="node 0's address and the JAX coordinator's port (needed with "
                         "--nnodes > 1; the agents also use PORT+1)")
    ap.add_argument("--rdzv-timeout", default=120.0, metavar="SECONDS",
                    type=_number(float, 0, strict=True, fix="the default is 120"),
                    help="how long the nodes wait for each other at start (default 120)")
    ap.add_argument("--islands", default=None, metavar="N",
                    type=_number(int, 1, strict=False, fix="leave it out for one job"),
                    help="run N independently failing islands (each -n processes) that meet at "
                         "DiLoCo's outer step through torchft; an island that dies is restarted "
                         "and rejoins (docs/islands.md; needs jddp[ft])")
    ap.add_argument("--quorum", type=_quorum_addr, default=None, metavar="HOST:PORT",
                    help="with --islands: torchft's Lighthouse; used if it runs there, else "
                         "started here on that address (default 127.0.0.1 and a free port)")
    ap.add_argument("--island-grace", default=3.0, metavar="SECONDS",
                    type=_number(float, 0, strict=True, fix="the default is 3"),
                    help="with --islands: the longest an outer step waits for an island that "
                         "stopped answering (default 3)")
    ap.add_argument("--no-prefix", action="store_true",
                    help="do not prefix output lines with [rankN]")
    ap.add_argument("-m", dest="module", action="store_true",
                    help="treat `script` as a module name, like python -m")
    ap.add_argument("script", help="the Python script (or module with -m) each rank runs")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `jddp-run` and `python -m jddp.launch`; returns the exit status."""
    ap = parser()
    launcher, script_args = ap.split(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(launcher)
    args.args = script_args
    if not args.node_rank < args.nnodes:
        ap.error(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}: nodes "
                 "count from 0, so --node-rank must be in [0, --nnodes)")
    if args.nnodes > 1 and args.master_addr is None:
        ap.error("--nnodes > 1 needs --master-addr HOST:PORT (node 0's address)")
    if args.master_addr is not None and args.port is not None:
        ap.error("give either --port or --master-addr HOST:PORT, not both")
    if args.islands is None and args.quorum is not None:
        ap.error("--quorum HOST:PORT goes with --islands N")
    if args.islands is not None:
        if args.nnodes > 1 or args.master_addr is not None:
            ap.error("--islands N runs each island as its own job: start one jddp-run per "
                     "island on other nodes instead of --nnodes (docs/islands.md)")
        from jddp._src.runtime.launch.islands import launch_islands

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # end the islands on the way out
        return launch_islands(
            (["-m"] if args.module else []) + [args.script] + list(args.args), args.islands,
            nprocs=args.nprocs, devices_per_process=args.devices_per_process,
            quorum=args.quorum, grace_s=args.grace, island_grace_s=args.island_grace,
            max_restarts=args.max_restarts if args.max_restarts else 100,
            timeout_s=args.timeout)
    command = [sys.executable, "-u"] + (["-m"] if args.module else []) + [args.script]
    return launch(
        command + list(args.args),
        args.nprocs,
        devices_per_process=args.devices_per_process,
        grace_s=args.grace,
        timeout_s=args.timeout,
        port=args.port,
        prefix_output=not args.no_prefix,
        step_timeout_s=args.step_timeout,
        first_step_timeout_s=args.first_step_timeout,
        max_restarts=args.max_restarts,
        preemption_grace_s=args.preemption_grace,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        rdzv_timeout_s=args.rdzv_timeout,
    )
