"""Checkpoints written by the round-3 release (commit f2b86e9, before the policies) restore
into a ``DataParallel`` spelled with the policies and continue to the parameters that release
reached (tests/fixtures/round3_checkpoints/make_round3.py says how they were made).

The DiLoCo case was saved on one process with a two-level mesh of 2 simulated hosts x 4
devices (``data_mesh(hosts=2)``); the same layout on 1 process x 8 devices restores it.
"""

import json
import os
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
import jddp.checkpoint as ck

FIXTURES = Path(__file__).parent / "fixtures" / "round3_checkpoints"


class MLP(nn.Module):  # make_round3.py's model
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(48, name="first")(x))
        x = nn.tanh(nn.Dense(32, name="mid")(x))
        return nn.Dense(5, name="head")(x)


MODEL = MLP()


def _params():
    return MODEL.init(jax.random.PRNGKey(3), jnp.zeros((1, 12)))["params"]


def _loss(p, b):
    logits = MODEL.apply({"params": p}, b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def _batch(i):
    r = np.random.RandomState(1000 + i)
    return {"x": jnp.asarray(r.randn(64, 12), jnp.float32),
            "y": jnp.asarray(r.randint(0, 5, 64), jnp.int32)}


# make_round3.py's round-3 keywords, in the new spelling.
CASES = {
    "stage0_adam": lambda: {},
    "stage3_adam_accum2": lambda: {"place": jddp.ZeRO(stage=3),
                                   "accumulate": jddp.Accumulate(steps=2)},
    "stage2_skip_loss_scale": lambda: {"place": jddp.ZeRO(stage=2),
                                       "loss_scale": jddp.SkipNotFinite()},
    "diloco_hosts2": lambda: {"mesh": jddp.data_mesh(hosts=2),
                              "sync": jddp.local_sgd.diloco(period=4)},
}


def _continue(name: str, tmp_path: Path) -> tuple[dict, dict]:
    """Restores the case's checkpoint (a copy: orbax may write next to it) and runs the calls
    make_round3.py ran after the save; returns the parameters reached and the stored ones."""
    case_dir = FIXTURES / name
    meta = json.loads((case_dir / "case.json").read_text())
    shutil.copytree(case_dir / "ckpt", tmp_path / "ckpt")
    ddp = jddp.DataParallel(_loss, optax.adam(3e-3), donate=False, **CASES[name]())
    mngr = ck.manager(os.fspath(tmp_path / "ckpt"))
    state = ck.restore(mngr, ddp.abstract_state(_params()))
    before = meta["calls_before_save"]
    for i in range(before, before + meta["calls_after"]):
        state, _ = ddp.step(state, _batch(i))
    got = jax.tree_util.tree_flatten_with_path(ddp.global_params(state))[0]
    got = {jax.tree_util.keystr(k): np.asarray(v) for k, v in got}
    with np.load(case_dir / "expected.npz") as expected:
        return got, dict(expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_round3_checkpoint_restores_and_continues_exactly(name, tmp_path):
    """The parameters reached after the restore equal those the round-3 release reached
    without one. Tolerance 1e-6 (make_round3.py's own bound): the fixtures were compiled at XLA's
    default optimisation level, the suite runs at level 0 (tests/conftest.py)."""
    got, expected = _continue(name, tmp_path)
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        np.testing.assert_allclose(got[key], want, rtol=0, atol=1e-6, err_msg=f"{name}: {key}")


CHILD = r"""
import os, pathlib, sys, tempfile, warnings
import numpy as np
from tests import test_round3_checkpoints as t
for name in sorted(t.CASES):
    with tempfile.TemporaryDirectory() as d:
        got, expected = t._continue(name, pathlib.Path(d))
        same = sorted(got) == sorted(expected) and all(
            np.array_equal(got[k], v) for k, v in expected.items())
        worst = max(float(np.max(np.abs(got[k] - v))) for k, v in expected.items())
        print(name, "BITWISE" if same else "DIFFERS", repr(worst))
"""


@pytest.mark.slow
def test_round3_checkpoints_continue_at_the_release_flags():
    """At the XLA flags make_round3.py ran with (default optimisation level, a child process: the
    suite's own backend runs at level 0), the continuation equals the round-3 release's within
    1e-6 for all four cases, and prints whether it is bitwise equal.

    Bitwise equality with the stored parameters holds where XLA:CPU generates the same code as
    on the machine that made them (it was bitwise there, in round 4's first session); XLA:CPU
    compiles for the host's instruction set, and on an AMD EPYC without AVX-512 (round 4's
    second session) all four differ in the last bits (worst 6.0e-8, DiLoCo; stage 0 Adam 1.5e-8), the
    round-3 release's own code included (checked at 6d7d08f). So the bound is what is asserted.
    """
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.fspath(Path(__file__).parent.parent))
    try:
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                             text=True, timeout=600, cwd=Path(__file__).parent.parent)
    except subprocess.TimeoutExpired as e:
        raise AssertionError("the child restoring the round-3 checkpoints did not finish in "
                             "600 s") from e
    assert out.returncode == 0, out.stderr[-3000:]
    rows = sorted(line.split() for line in out.stdout.splitlines() if line.split()[0] in CASES)
    assert [r[0] for r in rows] == sorted(CASES), out.stdout
    for name, verdict, worst in rows:
        assert verdict == "BITWISE" or float(worst) <= 1e-6, (name, verdict, worst)
