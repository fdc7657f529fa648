"""The main job: the digits example trains to high accuracy, alone and under the launcher."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.launch_util import REPO, child_env, rank_pids, run_launcher, wait_all_dead


@pytest.mark.slow
def test_digits_example_reaches_95_percent(tmp_path):
    out = tmp_path / "digits.json"
    proc = subprocess.run(
        [sys.executable, "examples/train_digits.py", "--devices", "8", "--epochs", "10",
         "--no-progress", "--json", str(out)],
        cwd=REPO, env=child_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["devices"] == 8 and result["steps"] == 10 * (1437 // 128)
    assert result["final_test_accuracy"] >= 0.95
    assert result["history"][-1]["loss"] < result["history"][0]["loss"]
    assert result["examples_per_second"] > 0


@pytest.mark.slow
def test_digits_example_under_launcher_matches_single_process(tmp_path):
    """2 processes x 4 devices train exactly like 1 process x 8 devices (same epoch losses)."""
    args = ["examples/train_digits.py", "--epochs", "2", "--no-progress"]
    single = subprocess.run([sys.executable, *args, "--devices", "8"], cwd=REPO,
                            env=child_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                            timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    rc, out, err, _ = run_launcher(["-n", "2", "--devices-per-process", "4", "--timeout", "200",
                                    *args], timeout=210, env=child_env(JAX_PLATFORMS="cpu"))
    assert rc == 0, (out[-2000:], err[-3000:])
    assert "[rank0] jddp digits:" in out and "8 devices (2 process(es))" in out
    assert "[rank1] epoch" not in out  # only the main process logs
    epochs = lambda text: re.findall(r"epoch\s+\d+: loss (\d+\.\d+)", text)
    assert epochs(out) == epochs(single.stdout) and len(epochs(out)) == 2


@pytest.mark.slow
def test_digits_example_survives_preemption_of_a_rank_bit_identically(tmp_path):
    """jddp-run --max-restarts: SIGTERM to rank 1 mid-training -> both ranks save at the same step
    and exit 75 -> the launcher restarts the job -> it resumes and ends with the same parameters
    as an uninterrupted run."""
    args = ["-n", "2", "--devices-per-process", "2", "--timeout", "250", "examples/train_digits.py",
            "--epochs", "1", "--no-progress"]
    env = child_env(JAX_PLATFORMS="cpu")
    rc, out, err, _ = run_launcher([*args, "--json", str(tmp_path / "plain.json")], timeout=260,
                                   env=env)
    assert rc == 0, (out[-2000:], err[-3000:])
    plain = json.loads((tmp_path / "plain.json").read_text())

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
