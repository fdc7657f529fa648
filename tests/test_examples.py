"""The main job: the digits example trains to high accuracy, alone and under the launcher."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.launch_util import REPO, child_env, run_launcher


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
