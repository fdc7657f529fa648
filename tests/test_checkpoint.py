"""Checkpoints: restore-and-continue is bit-identical to an uninterrupted run."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jddp
import jddp.checkpoint as ckpt
from tests._models import mlp_loss, mlp_params, regression_batch

SIZES = [6, 16, 16, 3]


def _batches(n):
    return [regression_batch(100 + s, 16, SIZES[0], SIZES[-1]) for s in range(n)]


def _run(ddp, state, batches):
    for b in batches:
        state, _ = ddp.step(state, b)
    return state


def _assert_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_restore_and_continue_is_bit_identical(tmp_path):
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2), bucket_cap_mb=0.001,
                            first_bucket_mb=0.0005)
    batches = _batches(6)
    uninterrupted = _run(ddp, ddp.init(params), batches)

    mngr = ckpt.manager(tmp_path / "ckpt", max_to_keep=2)
    half = _run(ddp, ddp.init(params), batches[:3])
    assert ckpt.save(mngr, half) == 3
    del half
    params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    restored = ckpt.restore(mngr, ddp.abstract_state(params_like))
    assert int(restored.step) == 3
    assert restored.params["Dense_0"]["kernel"].sharding.is_fully_replicated
    resumed = _run(ddp, restored, batches[3:])
    _assert_identical(resumed, uninterrupted)


def test_save_refuses_to_overwrite(tmp_path):
    ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
    state = ddp.init(mlp_params(0, SIZES))
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, state)
    with pytest.raises(FileExistsError, match="already exists"):
        ckpt.save(mngr, state)
    ckpt.save(mngr, state, overwrite=True)
    with pytest.raises(FileNotFoundError, match="No checkpoint of step 7"):
        ckpt.restore(mngr, state, step=7)
    with pytest.raises(FileNotFoundError, match="No checkpoint found"):
        ckpt.restore(ckpt.manager(tmp_path / "empty"), state)


def test_restore_or_init_starts_fresh_then_resumes_bit_identically(tmp_path):
    params = mlp_params(0, SIZES)
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2))
    batches = _batches(6)
    uninterrupted = _run(ddp, ddp.init(params), batches)

    mngr = ckpt.manager(tmp_path / "c", save_interval_steps=2)
    state = ckpt.restore_or_init(mngr, ddp, params)
    assert int(state.step) == 0 and mngr.latest_step() is None
    saved = []
    for step in range(4):  # "killed" after step 4
        state, _ = ddp.step(state, batches[step])
        saved.append(ckpt.save_if_due(mngr, state, step=step + 1))
    # orbax's policy: the first step (no checkpoint yet), then every save_interval_steps.
    assert saved == [True, True, False, True] and mngr.all_steps() == [1, 2, 4]
    assert not ckpt.save_if_due(mngr, state)  # step 4 again (read from the state): not due

    state = ckpt.restore_or_init(ckpt.manager(tmp_path / "c"), ddp, params)
    assert int(state.step) == 4
    _assert_identical(_run(ddp, state, batches[4:]), uninterrupted)


def test_sigterm_in_a_single_process_saves_at_the_next_step(tmp_path, monkeypatch):
    import os
    import signal

    import jddp.distributed as dist

    monkeypatch.setattr(dist, "_sigterm_seen", type(dist._sigterm_seen)())  # a fresh flag
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
        mngr = ckpt.manager(tmp_path / "c", save_interval_steps=100)
        state = ckpt.restore_or_init(mngr, ddp, mlp_params(0, SIZES))
        batches = _batches(3)
        state, _ = ddp.step(state, batches[0])
        assert ckpt.save_if_due(mngr, state, step=1)  # orbax's first save
        state, _ = ddp.step(state, batches[1])
        assert not ckpt.save_if_due(mngr, state, step=2)  # not due; installs the handler
        assert signal.getsignal(signal.SIGTERM) is dist._on_sigterm
        os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice: the process goes on
        state, _ = ddp.step(state, batches[2])
        assert dist.reached_preemption_point(3)
        assert ckpt.save_if_due(mngr, state, step=3, exit_on_preemption=False)
        assert mngr.all_steps() == [1, 3]
        # A second SIGTERM would end the process, as without jddp.
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_exit_for_resume_exits_with_75_after_the_preemption_save(tmp_path):
    import subprocess
    import sys

    from tests.launch_util import REPO, child_env

    code = f"""
import os, signal
import jax
jax.config.update("jax_num_cpu_devices", 2)
import optax, jddp, jddp.checkpoint as ckpt
from tests._models import mlp_loss, mlp_params, regression_batch
ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
mngr = ckpt.manager({str(tmp_path / "c")!r}, save_interval_steps=100)
state = ckpt.restore_or_init(mngr, ddp, mlp_params(0, {SIZES}))
for step in range(int(state.step), 10):
    state, _ = ddp.step(state, regression_batch(step, 16, {SIZES[0]}, {SIZES[-1]}))
    ckpt.save_if_due(mngr, state, step=step + 1)
    if step + 1 == 2:
        os.kill(os.getpid(), signal.SIGTERM)
print("FINISHED", int(state.step))
"""
    run = lambda: subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(),
                                 capture_output=True, text=True, timeout=120)
    first = run()
    assert first.returncode == 75, first.stderr[-3000:]
    assert "preempted: checkpoint of step 3 saved" in first.stderr
    assert "FINISHED" not in first.stdout
    second = run()  # the same command again resumes
    assert second.returncode == 0, second.stderr[-3000:]
    assert "FINISHED 10" in second.stdout
    assert ckpt.manager(tmp_path / "c").all_steps() == [1, 3]
