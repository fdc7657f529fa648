"""Which launcher started this process, and where its job's coordinator is: from the launcher's
environment variables, before JAX is asked.

JAX misses Open MPI 5 (PRRTE) and SLURM outside an ``srun`` step; jddp reads the launchers'
variables itself (formats from JAX's ``jax/_src/clusters``), joins with explicit coordinates,
and names the launcher and the fix when a rank of n > 1 has no coordinator (docs/cluster.md).
Standard library only: no JAX backend starts.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

__all__ = [
    "ENV_COORDINATOR_ADDRESS",
    "ENV_COORDINATOR_PORT",
    "ClusterEnvironmentError",
    "Launch",
    "NotInitializedError",
    "detect",
    "mark_single_process",
    "require_initialized",
]

# JAX's own overrides, honoured the same way here: the whole address, or only the port.
ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"

OPEN_MPI_4 = "Open MPI 4 (mpirun)"
OPEN_MPI_5 = "Open MPI 5 (mpirun, PRRTE)"
OPEN_MPI = "Open MPI (mpirun)"
SLURM = "SLURM (srun)"
SLURM_BATCH = "SLURM (sbatch/salloc, outside srun)"
HYDRA = "MPICH/Intel MPI (mpiexec, Hydra)"

# JAX's choice of a port when the launcher gives none: one in [61440, 65535] derived from the
# job, the same on every process. jddp derives the same ports, so a job keeps its port.
_PORT_BASE = 65535 - 2**12 + 1


class ClusterEnvironmentError(RuntimeError):
    """A launcher started this process as one of several, but no job can be joined from its
    variables (no coordinator address), or it was not started by the launcher's step at all."""


class NotInitializedError(RuntimeError):
    """A launcher started this process as one of several, and `jddp.initialize()` was not called
    before a data-parallel object was built: every rank would train alone."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """What a launcher's variables say about this process.

    Attributes:
      launcher: the launcher, for messages (e.g. "Open MPI 5 (mpirun, PRRTE)").
      local_process_id: its rank on its node, where the launcher says.
      nnodes: nodes of the job where the launcher says (None: unknown, > 1 counts as several).
      coordinator_address: "host:port" of process 0's coordinator; None if the variables give
        none (then `problem` says why and how to fix it).
      variables: the variables read, for messages ("OMPI_COMM_WORLD_SIZE=2, ...").
    """

    launcher: str
    num_processes: int
    process_id: int
    local_process_id: int | None
    nnodes: int | None
    coordinator_address: str | None
    variables: str
    problem: str | None = None


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ClusterEnvironmentError(
            f"jddp: the launcher's variable {name}={value!r} is not an integer") from None


def _shown(env: Mapping[str, str], names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}={env[n]}" for n in names if n in env)


def _port(env: Mapping[str, str], derived: int | None) -> int | None:
    """``JAX_COORDINATOR_PORT`` if set, else the port derived from the job."""
    given = _int(env, ENV_COORDINATOR_PORT)
    return given if given is not None else derived


def _address(env: Mapping[str, str], host: str | None, port: int | None) -> str | None:
    """``JAX_COORDINATOR_ADDRESS`` if set, else ``host:port`` (None if either is unknown)."""
    given = env.get(ENV_COORDINATOR_ADDRESS, "").strip()
    if given:
        return given
    if host is None or port is None:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _fix(launcher_flag: str) -> str:
    return (f"give the coordinator yourself: {launcher_flag} {ENV_COORDINATOR_ADDRESS}=<host of "
            "rank 0>:<free port> (or JDDP_COORDINATOR with JDDP_NUM_PROCESSES and "
            "JDDP_PROCESS_ID, or jddp.initialize(coordinator_address, num_processes, process_id))")


def _ompi_orte_host(uri: str) -> str | None:
    """mpirun's first address in ``OMPI_MCA_orte_hnp_uri`` (JAX's reading of it)."""
    m = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    return None if m is None else next(g for g in m.groups() if g is not None)


def _ompi_prrte_job(namespace: str) -> tuple[str, int] | None:
    """(mpirun's host, mpirun's pid) from Open MPI 5's ``PMIX_NAMESPACE``
    ("prterun-HOST-PID@N"), or None if it has another form."""
    m = re.fullmatch(r"(?:prterun|prte)-(.+)-(\d+)@\d+", namespace)
    return None if m is None else (m.group(1), int(m.group(2)))


def _open_mpi(env: Mapping[str, str]) -> Launch:
    names = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
             "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE", "PRTE_LAUNCHED")
    n = _int(env, "OMPI_COMM_WORLD_SIZE")
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    if n is None or rank is None:
        raise ClusterEnvironmentError(
            f"jddp: Open MPI's variables are incomplete ({_shown(env, names)}): "
            "OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK are both needed")
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    nnodes = _int(env, "OMPI_MCA_orte_num_nodes")  # Open MPI 4 only
    if local_size is not None and local_size >= n:
        nnodes = 1
    elif nnodes is None and local_size:
        nnodes = -(-n // local_size)  # several nodes (exact when each runs as many ranks)
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    prrte = _ompi_prrte_job(env.get("PMIX_NAMESPACE", ""))
    host, port, problem = None, None, None
    if uri:
        launcher = OPEN_MPI_4
        host = _ompi_orte_host(uri)
        jobid = uri.split(".", 1)[0]
        port = _PORT_BASE + (int(jobid) // 2**12) % 2**12 if jobid.isdigit() else None
    elif prrte is not None:
        launcher = OPEN_MPI_5
        host, port = prrte[0], _PORT_BASE + prrte[1] % 2**12
    else:
        launcher = OPEN_MPI_5 if "PMIX_NAMESPACE" in env or "PRTE_LAUNCHED" in env else OPEN_MPI
    port = _port(env, port)
    if nnodes == 1 and port is not None:
        host = "127.0.0.1"  # one node: every rank reaches process 0 on loopback
    address = _address(env, host, port)
    if address is None:
        problem = (f"{launcher} started {n} processes, but its variables give no coordinator "
                   "address (JAX reads one only from Open MPI 4's OMPI_MCA_orte_hnp_uri, and "
                   "this PMIX_NAMESPACE is not 'prterun-HOST-PID@N'); "
                   f"{_fix('mpirun -x')}")
    return Launch(launcher, n, rank, _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), nnodes, address,
                  _shown(env, names), problem)


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: "node001", "node[001-015],x", "node[001,007],x"."""
    cut = next((i for i, ch in enumerate(nodelist) if ch in ",["), len(nodelist))
    if cut == len(nodelist) or nodelist[cut] == ",":
        return nodelist[:cut]
    suffix = nodelist[cut + 1:]
    end = next((i for i, ch in enumerate(suffix) if ch in ",-]"), len(suffix))
    return nodelist[:cut] + suffix[:end]


def _slurm(env: Mapping[str, str]) -> Launch | None:
    names = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
             "SLURM_PROCID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST")
    in_step = "SLURM_STEP_NODELIST" in env or "SLURM_STEP_NUM_TASKS" in env
    if not in_step:
        tasks = _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS") or 1
        if tasks <= 1:
            return None
        return Launch(SLURM_BATCH, tasks, 0, None, _int(env, "SLURM_JOB_NUM_NODES"), None,
                      _shown(env, names),
                      f"this SLURM allocation has {tasks} tasks, but this process was not "
                      "started by srun (no SLURM_STEP_* variables), so it would train alone. "
                      "Start the script with `srun python ...` (also inside an sbatch script), "
                      "or, for one process on purpose, call "
                      "jddp.initialize(num_processes=1)")
    n = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
    rank = _int(env, "SLURM_PROCID")
    if n is None or rank is None:
        raise ClusterEnvironmentError(
            f"jddp: SLURM's step variables are incomplete ({_shown(env, names)}): "
            "SLURM_STEP_NUM_TASKS (or SLURM_NTASKS) and SLURM_PROCID are both needed")
    nnodes = _int(env, "SLURM_STEP_NUM_NODES") or _int(env, "SLURM_NNODES")
    jobid = _int(env, "SLURM_JOB_ID")
    port = _port(env, None if jobid is None else _PORT_BASE + jobid % 2**12)
    nodelist = env.get("SLURM_STEP_NODELIST", "")
    host = "127.0.0.1" if nnodes == 1 else (_first_host(nodelist) if nodelist else None)
    address = _address(env, host, port)
    problem = None if address is not None else (
        f"{SLURM} started {n} processes, but SLURM_JOB_ID or SLURM_STEP_NODELIST is missing, so "
        f"no coordinator address follows from them; {_fix('export')}")
    return Launch(SLURM, n, rank, _int(env, "SLURM_LOCALID"), nnodes, address,
                  _shown(env, names), problem)


def _hydra(env: Mapping[str, str]) -> Launch:
    names = ("PMI_SIZE", "PMI_RANK", ENV_COORDINATOR_ADDRESS)
    n = _int(env, "PMI_SIZE") or 1
    rank = _int(env, "PMI_RANK") or 0
    address = _address(env, None, None)
    problem = None if address is not None else (
        f"{HYDRA} started {n} processes, but its variables (PMI_SIZE, PMI_RANK) give no "
        f"coordinator address; {_fix('mpiexec -genv')}")
    return Launch(HYDRA, n, rank, _int(env, "MPI_LOCALRANKID"), None, address,
                  _shown(env, names), problem)


def detect(env: Mapping[str, str] | None = None) -> Launch | None:
    """What the launcher's variables in ``env`` (default ``os.environ``) say; None if no known
    launcher started this process (or one started it alone). Open MPI first (mpirun inside a
    SLURM allocation), then SLURM, then Hydra.

    Raises:
      ClusterEnvironmentError: a launcher's variables are malformed (not integers, incomplete).
    """
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_SIZE" in env or "OMPI_MCA_orte_hnp_uri" in env:
        return _open_mpi(env)
    if "SLURM_JOB_ID" in env:
        return _slurm(env)
    if "PMI_SIZE" in env:
        return _hydra(env)
    return None


# ------------------------------------------------------------- the "forgot initialize" check

_single_by_choice = False  # jddp.initialize(num_processes=1) was called


def mark_single_process() -> None:
    """Records that this process runs alone on purpose (`jddp.initialize(num_processes=1)`)."""
    global _single_by_choice
    _single_by_choice = True


def _started_as_rank(env: Mapping[str, str]) -> tuple[str, int, int] | None:
    """(launcher, rank, processes) if a launcher started this process as one of several."""
    n = _int(env, "JDDP_NUM_PROCESSES")
    if env.get("JDDP_COORDINATOR") and n is not None and n > 1:
        # A rank's own subprocess inherits the variables; only jddp-run's children are ranks.
        launcher_pid = env.get("JDDP_LAUNCHER_PID")
        if launcher_pid is not None and launcher_pid != str(os.getppid()):
            return None
        return "jddp-run", _int(env, "JDDP_PROCESS_ID") or 0, n
    try:
        launch = detect(env)
    except ClusterEnvironmentError:
        return None  # initialize() reports malformed variables; this check only adds to it
    if launch is None or launch.launcher == SLURM_BATCH or launch.num_processes <= 1:
        return None
    return launch.launcher, launch.process_id, launch.num_processes


def require_initialized(what: str) -> None:
    """Raises `NotInitializedError` if a launcher started this process as one of several and
    ``jax.distributed`` is not initialised: ``what`` (e.g. "data_mesh()") would then see only
    this process's devices, and every rank would train alone without a word.
    """
    if _single_by_choice:
        return
    started = _started_as_rank(os.environ)
    if started is None:
        return
    import jax  # here: the module itself stays importable without JAX

    if jax.distributed.is_initialized():
        return
    launcher, rank, n = started
    raise NotInitializedError(
        f"jddp: {what} was built in process {rank} of {n} started by {launcher}, but "
        "jax.distributed is not initialized, so this process would train alone as 'process 0 "
        "of 1' (and so would every other one). Call jddp.initialize() first, before any other "
        "JAX call; to run a single process on purpose, call jddp.initialize(num_processes=1).")
