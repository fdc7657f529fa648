"""Issue #37: jddp reads the launchers' variables itself (Open MPI 4 and 5, SLURM, Hydra), checks
the coordinator they give like an explicit one, and never falls back to a silent one-process job.
Issue #35 (2): a rank that forgets `jddp.initialize()` is refused when it builds a mesh.

The fast tests fake each launcher's variables (the sets a real mpirun/srun gives, from Open MPI
4.1.4's own output here and JAX's fixtures for Open MPI 5) in this process: every check they reach
runs before JAX is asked to connect anywhere. The real mpirun run is in tests/test_examples.py.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import optax
import pytest

import jddp
import jddp.distributed as dist
from jddp._src.runtime import cluster, coordinator, join
from tests.launch_util import REPO, child_env, run_launcher

# Open MPI 4.1.4, `mpirun -np 2 --mca oob_tcp_if_include lo` on this machine (rank 1; trimmed).
OMPI4 = {
    "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_orte_num_nodes": "1",
    "OMPI_MCA_orte_hnp_uri": "2029846528.0;tcp://127.0.0.1:37015",
    "PMIX_NAMESPACE": "2029846529", "PMIX_RANK": "1",
}
# Open MPI 5 (PRRTE) sets no OMPI_MCA_orte_hnp_uri (JAX issue #14576); its PMIx namespace names
# mpirun's host and pid. Rank 3 of 8, 4 per node.
OMPI5 = {
    "PRTE_LAUNCHED": "1", "PMIX_NAMESPACE": "prterun-node18-12345@1", "PMIX_RANK": "3",
    "PMIX_SERVER_URI41": "prterun-node18-12345@0.0;tcp4://10.20.30.40:45678",
    "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
# An srun step: 8 tasks on 4 nodes, this is task 5.
SLURM_STEP = {
    "SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[001-004],x",
    "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8",
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
}
CLUSTER_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "SLURM_", "PMI_", "JDDP_", "JAX_COORDINATOR")


def _port(base_job: int) -> int:
    return 65535 - 2**12 + 1 + base_job % 2**12


@pytest.fixture
def launcher_env(monkeypatch):
    """Clears every launcher variable of this process; returns a setter for a fake set."""
    for name in list(os.environ):
        if name.startswith(CLUSTER_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setattr(cluster, "_single_by_choice", False)

    def put(variables: dict[str, str]) -> None:
        for k, v in variables.items():
            monkeypatch.setenv(k, v)

    return put


# ------------------------------------------------------------------------- detection


def test_open_mpi_4_is_read_as_jax_reads_it():
    got = cluster.detect(OMPI4)
    port = _port(2029846528 // 2**12)
    assert got == cluster.Launch(cluster.OPEN_MPI_4, 2, 1, 1, 1, f"127.0.0.1:{port}",
                                 got.variables)
    # Several nodes: mpirun's first address, and the port JAX's own detection derives.
    many = {**OMPI4, "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "OMPI_MCA_orte_num_nodes": "2",
            "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}
    got = cluster.detect(many)
    from jax._src.clusters.ompi_cluster import OmpiCluster

    with pytest.MonkeyPatch.context() as mp:
        for k, v in many.items():
            mp.setenv(k, v)
        want = OmpiCluster.get_coordinator_address(None, None)
    assert (got.coordinator_address, got.nnodes, got.num_processes) == (want, 2, 8)


def test_open_mpi_5_is_read_from_its_pmix_namespace():
    got = cluster.detect(OMPI5)
    assert (got.launcher, got.num_processes, got.process_id, got.local_process_id,
            got.nnodes) == (cluster.OPEN_MPI_5, 8, 3, 1, 2)
    assert got.coordinator_address == f"node18:{_port(12345)}"  # mpirun's host, port from pid
    one_node = {**OMPI5, "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    assert cluster.detect(one_node).coordinator_address == f"127.0.0.1:{_port(12345)}"
    assert cluster.detect({**one_node, "JAX_COORDINATOR_PORT": "4321"}).coordinator_address \
        == "127.0.0.1:4321"
    assert cluster.detect({**OMPI5, "JAX_COORDINATOR_ADDRESS": "n7:99"}).coordinator_address \
        == "n7:99"


def test_slurm_step_is_read_as_jax_reads_it():
    got = cluster.detect(SLURM_STEP)
    from jax._src.clusters.slurm_cluster import SlurmCluster

    with pytest.MonkeyPatch.context() as mp:
        for k, v in SLURM_STEP.items():
            mp.setenv(k, v)
        want = SlurmCluster.get_coordinator_address(None, None)
    assert want == f"node001:{_port(1234)}"
    assert (got.launcher, got.coordinator_address, got.num_processes, got.process_id,
            got.local_process_id, got.nnodes) == (cluster.SLURM, want, 8, 5, 1, 4)
    for nodes, first in (("n17", "n17"), ("n[007,009-011]", "n007"), ("a,b", "a")):
        assert cluster._first_host(nodes) == first
    one_node = {**SLURM_STEP, "SLURM_STEP_NUM_NODES": "1"}
    assert cluster.detect(one_node).coordinator_address == f"127.0.0.1:{_port(1234)}"


def test_no_launcher_or_one_process_is_not_a_cluster():
    assert cluster.detect({}) is None
    assert cluster.detect({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1"}) is None  # sbatch -n1
    assert cluster.detect({**OMPI4, "OMPI_COMM_WORLD_SIZE": "1",
                           "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}).num_processes == 1


# ------------------------------------------- initialize(): named errors, never one process


def test_open_mpi_5_without_a_coordinator_is_a_named_error(launcher_env):
    # Variables of several processes whose namespace has another form: no address follows.
    launcher_env({**OMPI5, "PMIX_NAMESPACE": "2029846529"})
    del os.environ["PRTE_LAUNCHED"]
    with pytest.raises(dist.ClusterEnvironmentError) as e:
        dist.initialize()
    message = str(e.value)
    assert "Open MPI 5 (mpirun, PRRTE) started 8 processes" in message
    assert "mpirun -x JAX_COORDINATOR_ADDRESS=<host of rank 0>:<free port>" in message
    assert "OMPI_COMM_WORLD_SIZE=8" in message and not jax.distributed.is_initialized()


def test_python_in_an_sbatch_allocation_without_srun_is_a_named_error(launcher_env):
    launcher_env({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"})
    with pytest.raises(dist.ClusterEnvironmentError, match=r"srun python \.\.\.") as e:
        dist.initialize()
    assert "allocation has 2 tasks" in str(e.value)
    assert "jddp.initialize(num_processes=1)" in str(e.value)


def test_hydra_needs_a_coordinator_address(launcher_env):
    launcher_env({"PMI_SIZE": "2", "PMI_RANK": "1"})
    with pytest.raises(dist.ClusterEnvironmentError, match="mpiexec -genv JAX_COORDINATOR"):
        dist.initialize()
    got = cluster.detect({"PMI_SIZE": "2", "PMI_RANK": "1", "JAX_COORDINATOR_ADDRESS": "h:1"})
    assert (got.coordinator_address, got.num_processes, got.process_id) == ("h:1", 2, 1)


def test_num_processes_1_runs_one_process_whatever_the_launcher_says(launcher_env):
    launcher_env({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2"})
    info = dist.initialize(num_processes=1)
    assert (info.source, info.num_processes) == ("single", 1)
    launcher_env(OMPI4)
    jddp.data_mesh()  # chosen on purpose: no NotInitializedError


# ------------------------------------ the explicit-coordinate checks, from launcher variables


def test_port_in_use_under_a_launcher_is_named(launcher_env):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # Rank 0 of a one-node mpirun: the coordinator is on loopback, and its port is taken.
        launcher_env({**OMPI4, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                      "JAX_COORDINATOR_PORT": str(port)})
        with pytest.raises(dist.CoordinatorPortInUseError, match=f"port {port} is already in"):
            dist.initialize(timeout_s=2)
    assert not jax.distributed.is_initialized()


def test_unreachable_coordinator_under_a_launcher_times_out_named(launcher_env):
    from jddp.launch import free_port

    launcher_env({**SLURM_STEP, "SLURM_STEP_NUM_NODES": "1",
                  "JAX_COORDINATOR_PORT": str(free_port())})
    start = time.monotonic()
    with pytest.raises(dist.CoordinatorTimeoutError, match="127.0.0.1:"):
        dist.initialize(timeout_s=1)
    assert time.monotonic() - start < 10


def test_gloo_check_runs_under_a_launcher(launcher_env, monkeypatch):
    # An srun step on 4 nodes whose host name resolves to loopback: Gloo would listen where the
    # other nodes cannot connect. Before this, cluster mode skipped the check.
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")

    def no_network(*args, **kwargs):
        raise AssertionError("initialize went on past its Gloo check")

    monkeypatch.setattr(coordinator, "wait_for_coordinator", no_network)
    monkeypatch.setattr(jax.distributed, "initialize", no_network)
    launcher_env(SLURM_STEP)
    with pytest.raises(dist.GlooAddressError, match="JDDP_GLOO_INTERFACE"):
        dist.initialize(timeout_s=1)


def test_join_failure_names_the_launcher_and_the_fix():
    where = join.Where("cluster", "node18:61497", 8, 3, cluster.detect(OMPI5))
    message = join.join_failure(where, 120)
    assert "Open MPI 5 (mpirun, PRRTE)'s variables" in message
    assert "JAX_COORDINATOR_ADDRESS=<host of process 0>:<port>" in message


def test_loopback_coordinator_listens_on_loopback_only(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert coordinator.bind_address("127.0.0.1:5000") == "127.0.0.1:5000"
    assert coordinator.bind_address("node1:5000") is None  # JAX's default: every interface
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "10.0.0.1:5000")
    assert coordinator.bind_address("127.0.0.1:5000") == "10.0.0.1:5000"


# ------------------------------------------------- #35 (2): forgetting jddp.initialize()


def _loss(p, b):
    return ((b["x"] @ p["w"]) ** 2).mean()


def test_mesh_in_a_rank_without_initialize_is_refused(launcher_env):
    mesh = jddp.data_mesh()  # no launcher: fine
    launcher_env(OMPI4)
    with pytest.raises(dist.NotInitializedError, match="process 1 of 2 started by Open MPI 4"):
        jddp.data_mesh()
    with pytest.raises(dist.NotInitializedError, match="Call jddp.initialize"):
        jddp.DataParallel(_loss, optax.sgd(0.1), mesh=mesh)
    with pytest.raises(dist.NotInitializedError):
        jddp.data.Loader(np.zeros((16, 2), np.float32), global_batch_size=8, mesh=mesh)


def test_a_ranks_own_subprocess_is_not_a_rank(launcher_env):
    launcher_env({"JDDP_COORDINATOR": "127.0.0.1:1", "JDDP_NUM_PROCESSES": "2",
                  "JDDP_PROCESS_ID": "1", "JDDP_LAUNCHER_PID": str(os.getppid() + 100000)})
    jddp.data_mesh()  # a rank's subprocess inherits the variables, not the rank's role
    os.environ["JDDP_LAUNCHER_PID"] = str(os.getppid())
    with pytest.raises(dist.NotInitializedError, match="started by jddp-run"):
        jddp.data_mesh()


FORGETFUL = """
import jax, numpy as np, optax
import jddp
mesh = jddp.data_mesh()           # no jddp.initialize() before it
print("TRAINED ALONE", jax.process_index(), jax.process_count(), flush=True)
"""


@pytest.mark.slow
def test_script_without_initialize_under_jddp_run_fails_fast(tmp_path):
    script = tmp_path / "forgetful.py"
    script.write_text(FORGETFUL)
    rc, out, err, secs = run_launcher(["-n", "2", "--devices-per-process", "2", "--timeout", "60",
                                       str(script)], timeout=70)
    assert rc == 1, (out, err)
    assert "TRAINED ALONE" not in out
    assert "NotInitializedError" in err and "started by jddp-run" in err, err[-3000:]
    print(f"forgotten initialize under jddp-run -n 2: status {rc} after {secs:.1f} s")


# ---------------------------------------- a process with fake launcher variables, end to end


def _python(code: str, timeout: float, **env: str) -> tuple[int, str, str, float]:
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env=child_env(**env), cwd=REPO)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - start


@pytest.mark.slow
def test_digits_example_with_open_mpi_5_variables_and_no_coordinator_fails_at_once():
    env = {k: v for k, v in OMPI5.items() if k != "PRTE_LAUNCHED"}
    env.update(PMIX_NAMESPACE="2029846529", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE="2", JAX_PLATFORMS="cpu")
    start = time.monotonic()
    p = subprocess.run([sys.executable, "examples/train_digits.py", "--devices", "2",
                        "--epochs", "1", "--no-progress"], capture_output=True, text=True,
                       timeout=120, env=child_env(**env), cwd=REPO)
    secs = time.monotonic() - start
    assert p.returncode == 1, (p.stdout[-2000:], p.stderr[-2000:])
    assert "ClusterEnvironmentError" in p.stderr and "Open MPI" in p.stderr, p.stderr[-2000:]
    assert "final test accuracy" not in p.stdout  # it did not train alone
    print(f"Open MPI 5 variables, no coordinator: status {p.returncode} after {secs:.1f} s")


@pytest.mark.slow
def test_open_mpi_5_rank_without_peers_ends_with_the_launchers_name():
    from jddp.launch import free_port

    env = {**OMPI5, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "JAX_COORDINATOR_PORT": str(free_port()),
           "JAX_PLATFORMS": "cpu"}
    rc, out, err, secs = _python("""
        import jddp
        jddp.initialize(timeout_s=3)
        print("JOINED")
    """, timeout=60, **env)
    assert rc == 1 and "JOINED" not in out, (out, err)
    assert re.search(r"timed out after 3 s joining the job at 127\.0\.0\.1:\d+", err), err
    assert "Open MPI 5 (mpirun, PRRTE)'s variables" in err
    assert secs < 40
