"""`jddp-run`: start N local processes of a training script as one multi-process JAX job.

    jddp-run -n 2 --devices-per-process 2 train.py --lr 0.1
    jddp-run -n 2 --step-timeout 60 --max-restarts 3 train.py --checkpoint-dir ckpt
    python -m jddp.launch -n 2 -m mypackage.train --lr 0.1

Each rank gets the `JDDP_*` variables that `jddp.distributed.initialize` reads (coordinator on
127.0.0.1 and a free port, process count and id, simulated CPU devices, restart count) and one end
of a Unix socket pair to the launcher (`JDDP_CONTROL_FD`). Output
lines are prefixed with the rank. What ends a job, and with which exit status (docs/faults.md has
the whole table, with measured times):

* a rank fails: the others are ended, status = that rank's status;
* the watchdog (`--step-timeout`, `--first-step-timeout`): no rank completed a training step for
  that long, status `EXIT_STUCK`, with each rank's last completed step;
* a rank exits normally while another is inside a step that needs it: `EXIT_EARLY`;
* preemption: SIGTERM to the launcher is passed to each rank, which finishes its step, saves a
  checkpoint at the same step as the others and exits with `EXIT_RESUME`; so does the job;
* `--timeout` (124); Ctrl-C, SIGHUP (128 + N).

Ending ranks: an `abort` order over each rank's socket (its jddp thread calls `os._exit` even while
the main thread is blocked in a collective), SIGTERM to each rank's process group, SIGKILL after
`--grace` seconds. JAX's preemption service makes a rank ignore SIGTERM, so the escalation is what
ends a stuck rank that runs no jddp thread.

`--max-restarts N` runs the whole job again, on a fresh coordinator port, after a failure or a
preemption, up to N times; the script resumes from its latest checkpoint
(`jddp.checkpoint.restore_or_init`).

A guardian process, in a session of its own, kills every rank's process group if the launcher
dies, whatever kills it (SIGKILL included): each rank leads its own group (so that ending a rank
reaches its children), so nothing sent to the launcher's group reaches the ranks by itself.
"""

import sys

from jddp._src.runtime.coordinator import EXIT_RESUME
from jddp._src.runtime.launch.agent import launch
from jddp._src.runtime.launch.cli import main
from jddp._src.runtime.launch.procs import (
    EXIT_EARLY,
    EXIT_PORT_IN_USE,
    EXIT_STUCK,
    EXIT_TIMEOUT,
    build_rank_env,
    exit_status,
    free_port,
)

__all__ = [
    "EXIT_EARLY",
    "EXIT_PORT_IN_USE",
    "EXIT_RESUME",
    "EXIT_STUCK",
    "EXIT_TIMEOUT",
    "build_rank_env",
    "exit_status",
    "free_port",
    "launch",
    "main",
]

if __name__ == "__main__":
    sys.exit(main())
