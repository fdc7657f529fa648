"""The examples: digits trains to high accuracy, alone and under the launcher; the ResNet (SyncBN)
and Transformer LM ports of Flax's examples train, evaluate and resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.launch_util import (
    REPO,
    child_env,
    compile_cache,
    rank_pids,
    run_launcher,
    wait_all_dead,
)


@pytest.fixture(scope="module")
def digits_on_8_devices(tmp_path_factory):
    """One run of the digits example on 1 process x 8 devices (10 epochs, --profile), shared by
    the accuracy test and, as its reference, the launcher test (epochs 1-2 of this run are the
    same training as a 2-epoch run: same seed, batches and program)."""
    tmp = tmp_path_factory.mktemp("digits8")
    out = tmp / "digits.json"
    proc = subprocess.run(
        [sys.executable, "examples/train_digits.py", "--devices", "8", "--epochs", "10",
         "--no-progress", "--json", str(out), "--profile", str(tmp / "prof")],
        cwd=REPO, env=child_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), tmp


@pytest.mark.slow
def test_digits_example_reaches_95_percent(digits_on_8_devices):
    proc, result, tmp = digits_on_8_devices
    assert result["devices"] == 8 and result["steps"] == 10 * (1437 // 128)
    assert result["final_test_accuracy"] >= 0.95
    assert result["history"][-1]["loss"] < result["history"][0]["loss"]
    assert result["examples_per_second"] > 0
    # --profile: 5 steps timed and traced, each bucket's all-reduce named and timed.
    prof = result["profile"]
    assert prof["steps"] == 5 and prof["dispatch_ms"] > 0 and prof["device_ms"] > 0
    assert prof["collective_ms"] > 0 and [c["bucket"] for c in prof["collectives"]] == [0]
    assert prof["collectives"][0]["calls"] == 5 * 8
    assert "in collectives" in proc.stdout + proc.stderr
    assert list((tmp / "prof").rglob("perfetto_trace.json.gz"))


@pytest.mark.slow
def test_digits_example_under_launcher_matches_single_process(digits_on_8_devices):
    """2 processes x 4 devices train exactly like 1 process x 8 devices (same epoch losses)."""
    single = digits_on_8_devices[0]
    args = ["examples/train_digits.py", "--epochs", "2", "--no-progress"]
    rc, out, err, _ = run_launcher(["-n", "2", "--devices-per-process", "4", "--timeout", "200",
                                    *args], timeout=210, env=child_env(JAX_PLATFORMS="cpu"))
    assert rc == 0, (out[-2000:], err[-3000:])
    assert "[rank0] jddp digits:" in out and "8 devices (2 process(es))" in out
    # jddp.data.Loader: each process reads only its half of every global batch of 128.
    assert "64 rows of each read by this process" in out
    assert "128 rows of each read by this process" in single.stdout
    assert "[rank1] epoch" not in out  # only the main process logs
    epochs = lambda text: re.findall(r"epoch\s+\d+: loss (\d+\.\d+)", text)
    assert len(epochs(out)) == 2 and len(epochs(single.stdout)) == 10
    assert epochs(out) == epochs(single.stdout)[:2]


MPIRUN = shutil.which("mpirun")
# The digits example as one 2-process job of 2 devices each, 3 epochs: jddp-run's result, the
# reference of the mpirun test and of the preemption test (its plain, uninterrupted run).
# (--devices 2 is the mpirun run's device count; jddp-run's --devices-per-process overrides it.)
DIGITS_2X2 = ["examples/train_digits.py", "--devices", "2", "--epochs", "3", "--no-progress"]


@pytest.fixture(scope="module")
def digits_2x2(tmp_path_factory):
    """(result JSON, compile-cache env) of one uninterrupted `jddp-run -n 2` run of DIGITS_2X2;
    the cache holds its programs, for the preemption test's restarted ranks."""
    tmp = tmp_path_factory.mktemp("digits2x2")
    env = child_env(JAX_PLATFORMS="cpu", **compile_cache(tmp / "jax-cache"))
    rc, out, err, _ = run_launcher(
        ["-n", "2", "--devices-per-process", "2", "--timeout", "250", *DIGITS_2X2, "--json",
         str(tmp / "plain.json")], timeout=260, env=env)
    assert rc == 0, (out[-2000:], err[-3000:])
    return json.loads((tmp / "plain.json").read_text()), env


def _mpirun(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str, float]:
    """`mpirun -np 2 python ARGS` on this machine, coordinator and Open MPI's own traffic on
    loopback; the whole process group is killed if it outlives `timeout`."""
    cmd = [MPIRUN, "-np", "2", "--oversubscribe", "--bind-to", "none", "--mca",
           "oob_tcp_if_include", "lo", sys.executable, *args]
    start = time.monotonic()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"mpirun did not finish in {timeout} s\n{out[-2000:]}\n"
                             f"{err[-3000:]}") from None
    return p.returncode, out, err, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.skipif(MPIRUN is None, reason="Open MPI's mpirun is not installed (Debian: apt-get "
                    "install openmpi-bin; .ci/run installs it when run as root)")
def test_digits_example_under_mpirun_equals_jddp_run(tmp_path, digits_2x2):
    """Issue #37: under mpirun the example joins one 2-process job (it used to train each rank
    alone), and its result is jddp-run's, bit for bit."""
    # No shared compilation cache: the mpirun job compiles its own programs.
    env = child_env(JAX_PLATFORMS="cpu", OMPI_ALLOW_RUN_AS_ROOT="1",
                    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    rc, out, err, mpi_secs = _mpirun([*DIGITS_2X2, "--json", str(tmp_path / "mpirun.json")], env,
                                     240)
    assert rc == 0, (out[-2000:], err[-3000:])
    assert "4 devices (2 process(es))" in out, out[-2000:]
    want = digits_2x2[0]
    got = json.loads((tmp_path / "mpirun.json").read_text())
    assert got["processes"] == want["processes"] == 2 and got["devices"] == 4
    assert got["params_sha256"] == want["params_sha256"]
    assert got["params"] == want["params"] and got["final_loss"] == want["final_loss"]
    assert [h["loss"] for h in got["history"]] == [h["loss"] for h in want["history"]]
    print(f"digits, 2 x 2 devices, 3 epochs: mpirun {mpi_secs:.1f} s, "
          f"params_sha256 {got['params_sha256'][:16]} as jddp-run's")


def _slurm_reachable() -> bool:
    """An idle SLURM node answers (srun and sinfo installed, a controller running)."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                           timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return p.returncode == 0 and "idle" in p.stdout


@pytest.mark.slow
@pytest.mark.skipif(not _slurm_reachable(), reason="no SLURM cluster answers here (sinfo); "
                    "docs/cluster.md has the measured srun runs")
def test_digits_example_under_srun_equals_jddp_run(tmp_path):
    """Issue #37: `srun -N1 -n2` runs the example as one 2-process job, jddp-run's result."""
    args = ["examples/train_digits.py", "--devices", "2", "--epochs", "1", "--no-progress"]
    env = child_env(JAX_PLATFORMS="cpu")
    for name in ("SLURM_CONF",):  # child_env drops SLURM_*: srun needs to find its cluster
        if name in os.environ:
            env[name] = os.environ[name]
    rc, out, err, _ = run_launcher(["-n", "2", "--devices-per-process", "2", "--timeout", "200",
                                    *args, "--json", str(tmp_path / "jddp_run.json")],
                                   timeout=210, env=env)
    assert rc == 0, (out[-2000:], err[-3000:])
    p = subprocess.run(["srun", "-N1", "-n2", "--kill-on-bad-exit=1", sys.executable, *args,
                        "--json", str(tmp_path / "srun.json")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    want = json.loads((tmp_path / "jddp_run.json").read_text())
    got = json.loads((tmp_path / "srun.json").read_text())
    assert got["processes"] == 2 and got["devices"] == 4
    assert got["params_sha256"] == want["params_sha256"]


@pytest.mark.slow
def test_digits_example_survives_preemption_of_a_rank_bit_identically(tmp_path, digits_2x2):
    """jddp-run --max-restarts: SIGTERM to rank 1 mid-training -> both ranks save at the same step
    and exit 75 -> the launcher restarts the job -> it resumes and ends with the same parameters
    as an uninterrupted run."""
    # Three epochs (33 steps, ~0.4 s of training after the first save): with one, the 8 steps
    # left after step 3's checkpoint appeared sometimes ended before the SIGTERM arrived, and
    # the job finished unpreempted (seen once in a clean clone's suite).
    args = ["-n", "2", "--devices-per-process", "2", "--timeout", "250", *DIGITS_2X2]
    # The plain run (digits_2x2), the preempted attempt and the restarted one compile the same
    # programs: the later ranks load them from the plain run's compilation cache.
    plain, env = digits_2x2

    ckpt = tmp_path / "ckpt"
    p = subprocess.Popen(
        [sys.executable, "-m", "jddp.launch", "--max-restarts", "1", *args, "--checkpoint-dir",
         str(ckpt), "--save-every", "3", "--json", str(tmp_path / "resumed.json")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        deadline = time.monotonic() + 200
        while not (ckpt / "3").is_dir():  # training is under way: preempt rank 1
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        ranks = rank_pids(p.pid)
        pids = list(ranks.values())
        if 1 in ranks:
            os.kill(ranks[1], signal.SIGTERM)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert set(ranks) == {0, 1}, ranks
    assert p.returncode == 0, (out[-2000:], err[-3000:])
    assert "job preempted: rank(s) 0, 1 saved a checkpoint" in err
    assert "restarting the job (1 of 1 restarts)" in err
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert 3 <= resumed["resumed_from_step"] < resumed["steps"] == plain["steps"]
    assert resumed["params_sha256"] == plain["params_sha256"]
    assert resumed["final_test_accuracy"] == plain["final_test_accuracy"]
    assert wait_all_dead(pids) == []


def _run_example(args, tmp_path, name, **env):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, *args, "--no-progress", "--json", str(out)],
        cwd=REPO, env=child_env(JAX_PLATFORMS="cpu", **env), capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_resnet_example_trains_with_syncbn_and_evaluates_every_test_image(tmp_path):
    """A tiny ResNet for 3 short epochs: the loss falls, the learning rate follows the warmup,
    the 360 test images (not a multiple of the batch) are each counted once, a PNG is written."""
    result, out = _run_example(
        ["examples/train_resnet.py", "--epochs", "3", "--batch-size", "64", "--widths", "8,8,16",
         "--warmup-epochs", "1", "--png", str(tmp_path / "resnet.png")], tmp_path, "resnet")
    assert "SyncBN over 8 devices" in out
    hist = result["history"]
    assert result["steps"] == 3 * (1437 // 64) and result["test_examples"] == 360
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    assert hist[-1]["test_loss"] < hist[0]["test_loss"]
    lrs = [r["learning_rate"] for r in result["steps_log"]]
    assert lrs[0] < lrs[21] and lrs[-1] < lrs[21]  # warmup, then cosine decay
    assert (tmp_path / "resnet.png").stat().st_size > 10_000


LM_TINY = ["examples/train_lm.py", "--steps", "12", "--eval-every", "6", "--width", "32",
           "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch-size", "16",
           "--train-mb", "0.2", "--eval-sequences", "64", "--warmup-steps", "3"]


@pytest.mark.slow
def test_lm_example_trains_and_resumes_bit_identically(tmp_path):
    """A tiny LM for 12 steps: the loss and the held-out perplexity fall. Restarted from its
    step-6 checkpoint, it ends exactly where the uninterrupted run ended (batches and dropout
    keys follow from the step)."""
    ckpt = tmp_path / "ckpt"
    # The resumed run compiles the same programs: it loads them from this test's cache.
    cache = compile_cache(tmp_path / "jax-cache")
    result, out = _run_example([*LM_TINY, "--checkpoint-dir", str(ckpt), "--save-every", "6"],
                               tmp_path, "lm", **cache)
    assert result["steps"] == 12 and result["resumed_from_step"] == 0
    losses = [r["loss"] for r in result["steps_log"]]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert result["evals"][-1]["eval_perplexity"] < result["evals"][0]["eval_perplexity"]
    assert sum(r["tokens"] for r in result["steps_log"]) > 0
    assert "perplexity" in out
    shutil.rmtree(ckpt / "12")  # as if the job had died after step 6's checkpoint
    resumed, out = _run_example([*LM_TINY, "--checkpoint-dir", str(ckpt)], tmp_path, "resumed",
                                **cache)
    assert resumed["resumed_from_step"] == 6 and "resumed from the checkpoint of step 6" in out
    assert resumed["final_eval_loss"] == result["final_eval_loss"]
    assert resumed["sample"] == result["sample"]
