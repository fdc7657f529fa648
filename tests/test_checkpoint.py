"""Checkpoints: restore-and-continue is bit-identical to an uninterrupted run."""

from __future__ import annotations

import functools

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
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-2),
                            reduce=jddp.Buckets(cap_mb=0.001, first_mb=0.0005))
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
    # Only on the interval (orbax's default would also save the first step).
    assert saved == [False, True, False, True] and mngr.all_steps() == [2, 4]
    assert not ckpt.save_if_due(mngr, state)  # step 4 again (read from the state): not due

    state = ckpt.restore_or_init(ckpt.manager(tmp_path / "c"), ddp, params)
    assert int(state.step) == 4
    _assert_identical(_run(ddp, state, batches[4:]), uninterrupted)


def test_sigterm_in_a_single_process_saves_at_the_next_step(tmp_path, monkeypatch):
    import os
    import signal

    import jddp.distributed as dist
    from jddp._src.runtime import preemption

    monkeypatch.setattr(preemption, "_sigterm_seen", type(preemption._sigterm_seen)())  # fresh
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ddp = jddp.DataParallel(mlp_loss, optax.sgd(0.1))
        mngr = ckpt.manager(tmp_path / "c", save_interval_steps=100)
        state = ckpt.restore_or_init(mngr, ddp, mlp_params(0, SIZES))
        batches = _batches(3)
        state, _ = ddp.step(state, batches[0])
        assert not ckpt.save_if_due(mngr, state, step=1)  # not due: no first-step save
        state, _ = ddp.step(state, batches[1])
        assert not ckpt.save_if_due(mngr, state, step=2)  # not due; installs the handler
        assert signal.getsignal(signal.SIGTERM) is preemption._on_sigterm
        os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice: the process goes on
        state, _ = ddp.step(state, batches[2])
        assert dist.reached_preemption_point(3)
        assert ckpt.save_if_due(mngr, state, step=3, exit_on_preemption=False)
        assert mngr.all_steps() == [3]
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
    assert ckpt.manager(tmp_path / "c").all_steps() == [3]  # the preemption save only


# ----------------------------------------------------------------- another number of devices


def _on(n, hook=None, stage=0, shard="even", **options):
    mesh = jddp.data_mesh(jax.devices()[:n])
    return jddp.DataParallel(mlp_loss, optax.adam(1e-2), mesh=mesh,
                             reduce=jddp.Buckets(cap_mb=0.001, first_mb=0.0005, hook=hook),
                             place=jddp.ZeRO(stage=stage, shard=shard) if stage
                             else jddp.Replicate(), **options)


@functools.cache
def _shared(n, stage=0, shard="even"):
    """``_on``'s plain trainer, one per configuration for this module: the tests that only train,
    save and restore with it share its compiled programs (a new trainer compiles them again)."""
    return _on(n, stage=stage, shard=shard)


def _host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("old,new", [(8, 4), (4, 8)])
def test_replicated_state_restores_on_another_device_count(tmp_path, old, new):
    """Params and optimizer state are the same on every device: they reshard, and training goes
    on exactly as it would have on the old device count (to float rounding of the reduction)."""
    params, batches = mlp_params(1, SIZES), _batches(4)
    a = _shared(old)
    state = _run(a, a.init(params), batches[:2])
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, state)
    ref = _run(a, state, batches[2:])
    b = _shared(new)
    restored = ckpt.restore_or_init(mngr, b, params)
    assert restored.params["Dense_0"]["kernel"].sharding.mesh.size == new
    after = _run(b, restored, batches[2:])
    for x, y in zip(jax.tree.leaves(_host(after.params)), jax.tree.leaves(_host(ref.params)),
                    strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("old,new", [(8, 4), (4, 8)])
def test_powersgd_state_restarts_with_a_warning(tmp_path, old, new):
    hook = jddp.powersgd(rank=1, start_iter=0, min_compression_rate=1.0)
    params = mlp_params(2, SIZES)
    a = _on(old, hook=hook)
    state = _run(a, a.init(params), _batches(2))
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, state)
    b = _on(new, hook=hook)
    with pytest.warns(UserWarning, match=rf"saved on {old} devices, restored on {new}.*error "
                                         "feedback"):
        restored = ckpt.restore_or_init(mngr, b, params)
    fresh = b.init(params)
    _assert_identical(restored.reduce_state, fresh.reduce_state)
    _assert_identical(restored.params, state.params)  # everything else is the checkpoint's
    assert int(restored.step) == 2
    _run(b, restored, _batches(1))  # and it trains


def test_accumulator_restores_at_a_window_boundary_only(tmp_path):
    params, batches = mlp_params(3, SIZES), _batches(3)
    a = _on(8, accumulate=jddp.Accumulate(steps=2))
    state = _run(a, a.init(params), batches[:2])  # one full window: count is 0 again
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, state, step=100)
    b = _on(4, accumulate=jddp.Accumulate(steps=2))
    restored = ckpt.restore(mngr, b.abstract_state(params), init_fn=lambda: b.init(params))
    assert int(restored.update_state.count) == 0 and restored.update_state.loss.shape == (4,)
    _assert_identical(restored.params, state.params)

    mid = _run(a, state, batches[2:3])  # count 1: mid-window
    ckpt.save(mngr, mid, step=101)
    with pytest.raises(ValueError, match=r"saved on 8 devices, restored on 4.*middle of a gradient "
                                         r"accumulation window.*Resume on 8 devices"):
        ckpt.restore(mngr, b.abstract_state(params), step=101, init_fn=lambda: b.init(params))


def test_sharded_accumulator_checkpoints_like_the_per_device_one(tmp_path):
    """Stage 3's sharded accumulator (split like the parameters): mid-window it restores on the
    same device count and the window ends as if uninterrupted; on another device count the
    existing error names the window; at a window boundary it restores anywhere."""
    params, batches = mlp_params(3, SIZES), _batches(4)
    a = _on(8, stage=3, accumulate=jddp.Accumulate(steps=2))
    assert a.config.accumulate.shard
    mid = _run(a, a.init(params), batches[:1])
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, mid, step=1)
    reference = _run(a, mid, batches[1:2])
    restored = ckpt.restore(mngr, a.abstract_state(params), step=1)
    assert int(restored.update_state.count) == 1
    _assert_identical(_run(a, restored, batches[1:2]), reference)
    b = _on(4, stage=3, accumulate=jddp.Accumulate(steps=2))
    with pytest.raises(ValueError, match=r"saved on 8 devices, restored on 4.*middle of a gradient "
                                         r"accumulation window"):
        ckpt.restore(mngr, b.abstract_state(params), step=1, init_fn=lambda: b.init(params))
    ckpt.save(mngr, reference, step=2)  # a window boundary
    restored = ckpt.restore(mngr, b.abstract_state(params), step=2, init_fn=lambda: b.init(params))
    assert int(restored.update_state.count) == 0 and int(restored.step) == 1
    _run(b, restored, batches[2:4])  # and it trains


def test_per_replica_model_state_does_not_restore_on_another_device_count(tmp_path):
    import jax.numpy as jnp

    def loss(p, ms, batch):
        return mlp_loss(p, batch), {"n": ms["n"] + 1.0}

    params = mlp_params(4, SIZES)
    mesh8, mesh4 = jddp.data_mesh(jax.devices()[:8]), jddp.data_mesh(jax.devices()[:4])
    a = jddp.DataParallel(loss, optax.sgd(0.1), mesh=mesh8, loss=jddp.Loss(model_state_sync="none"))
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, a.init(params, {"n": jnp.zeros(())}))
    b = jddp.DataParallel(loss, optax.sgd(0.1), mesh=mesh4, loss=jddp.Loss(model_state_sync="none"))
    with pytest.raises(ValueError, match=r"one model state per device.*Restore on 8 devices"):
        ckpt.restore_or_init(mngr, b, params, {"n": jnp.zeros(())})


def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    a = _shared(8)
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, a.init(mlp_params(5, SIZES)))
    other = mlp_params(5, [6, 16, 4, 3])
    with pytest.raises(ValueError, match=r"Dense_1.bias has shape \(16,\), but this trainer's state has \(4,\)"):
        ckpt.restore_or_init(mngr, a, other)
    with pytest.raises(ValueError, match="does not hold the state this trainer builds"):
        ckpt.restore_or_init(mngr, _on(8, accumulate=jddp.Accumulate(steps=2)), mlp_params(5,
                                                                                           SIZES))


# ------------------------------------------------------------------------------ sharded stages


@pytest.mark.parametrize("saved,resumed", [
    ((3, 8), (3, 8)), ((3, 8), (3, 4)), ((2, 4), (2, 8)), ((0, 8), (3, 8)), ((3, 8), (0, 4)),
    # owner sharding keeps the optimizer state packed per owner; a checkpoint holds optax's own
    ((3, 8, "owner"), (3, 8, "owner")), ((2, 8, "owner"), (3, 4)), ((3, 8), (1, 8, "owner")),
    ((1, 8, "owner"), (2, 4, "owner")), ((3, 8, "owner"), (0, 8))],
    ids=lambda c: "-".join(map(str, c)))
def test_sharded_state_restores_on_any_device_count_and_stage(tmp_path, saved, resumed):
    """A checkpoint holds every leaf at its true shape (owner sharding's packed optimizer state
    as optax's own tree), so it restores bit-exactly onto the same layout, and onto another
    device count, stage or shard by resharding; training then goes on like an uninterrupted run
    at the old configuration (bit-exact on the same layout, to float rounding of the reduction
    otherwise)."""
    (s_stage, s_n, *s_shard), (r_stage, r_n, *r_shard) = saved, resumed
    params, batches = mlp_params(6, SIZES), _batches(4)
    a = _shared(s_n, stage=s_stage, shard=(s_shard or ["even"])[0])
    state = _run(a, a.init(params), batches[:2])
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, state)
    reference = _run(a, state, batches[2:])
    b = _shared(r_n, stage=r_stage, shard=(r_shard or ["even"])[0])
    restored = ckpt.restore_or_init(mngr, b, params)
    assert int(restored.step) == 2
    want = b.abstract_state(params)
    for got, spec in zip(jax.tree.leaves(restored), jax.tree.leaves(want), strict=True):
        assert got.sharding == spec.sharding
    resumed_state = _run(b, restored, batches[2:])
    if saved == resumed:
        _assert_identical(resumed_state, reference)
    else:
        for x, y in zip(jax.tree.leaves(_host(resumed_state.params)),
                        jax.tree.leaves(_host(reference.params)), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


KILL_SCRIPT = r'''
import glob, os, signal, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
import jax.numpy as jnp
import numpy as np
import optax
import jddp
import jddp.checkpoint as ckpt

mode, directory = sys.argv[1:3]
rng = np.random.default_rng(0)
params = {"w": (rng.standard_normal((2048, 4096)) * 0.01).astype(np.float32),  # 32 MiB
          "v": rng.standard_normal((4096,)).astype(np.float32)}

def loss_fn(p, b):
    return jnp.mean((b["x"] @ p["w"] @ p["v"] - b["y"]) ** 2)

ddp = jddp.DataParallel(loss_fn, optax.adam(1e-3), mesh=jddp.data_mesh())
batch = lambda s: {"x": np.random.default_rng(s).standard_normal((4, 2048)).astype(np.float32),
                   "y": np.random.default_rng(s).standard_normal(4).astype(np.float32)}
mngr = ckpt.manager(os.path.join(directory, "ckpt"), save_interval_steps=2, async_save=True)
state = ckpt.restore_or_init(mngr, ddp, params)
print("START", int(state.step), flush=True)
for step in range(int(state.step), 6):
    state, _ = ddp.step(state, batch(step))
    saved = ckpt.save_if_due(mngr, state, step=step + 1)
    if mode == "kill" and step + 1 == 4:
        assert saved
        pending = glob.glob(os.path.join(directory, "ckpt", "4.orbax-checkpoint-tmp*"))
        print("PENDING", len(pending), flush=True)  # the write of step 4 is under way
        os.kill(os.getpid(), signal.SIGKILL)
ckpt.wait(mngr)
np.savez(os.path.join(directory, "resume.npz"), **jax.tree.map(np.asarray, state.params))
# The reference, a run never interrupted (no checkpoints at all), in this process: one process
# launch less, and the same compiled step program.
plain = ddp.init(params)
for step in range(6):
    plain, _ = ddp.step(plain, batch(step))
np.savez(os.path.join(directory, "plain.npz"), **jax.tree.map(np.asarray, plain.params))
'''


@pytest.mark.slow
def test_async_save_killed_mid_write_resumes_from_the_last_complete_checkpoint(tmp_path):
    """SIGKILL while an asynchronous save is being written: no checkpoint of that step exists
    afterwards (atomic), the restart resumes from the one before, saves that step again over the
    left-over temporary folder, and ends bit-identical to a run never interrupted."""
    import subprocess
    import sys

    from tests.launch_util import REPO, child_env, compile_cache

    script = tmp_path / "job.py"
    script.write_text(KILL_SCRIPT)
    # The restarted process compiles the killed one's programs: it loads them from this test's
    # compilation cache.
    env = child_env(**compile_cache(tmp_path / "jax-cache"))
    run = lambda mode: subprocess.run([sys.executable, str(script), mode, str(tmp_path)],
                                      cwd=REPO, env=env, capture_output=True, text=True,
                                      timeout=180)
    killed = run("kill")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "PENDING 1" in killed.stdout  # killed mid-write, not after it
    assert ckpt.manager(tmp_path / "ckpt").all_steps() == [2]  # no half-written step 4
    resumed = run("resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "START 2" in resumed.stdout
    assert ckpt.manager(tmp_path / "ckpt").all_steps() == [2, 4, 6]
    with np.load(tmp_path / "plain.npz") as a, np.load(tmp_path / "resume.npz") as b:
        for k in ("w", "v"):
            np.testing.assert_array_equal(a[k], b[k])


def _nnx_trainer(seed, **options):
    """A fresh ``jddp.nnx.DataParallel`` over a model with BatchNorm statistics and a dropout
    RNG stream (its model state holds typed PRNG keys and counts), built from ``seed``."""
    import jax.numpy as jnp
    from flax import nnx

    import jddp.nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(SIZES[0], 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.25, rngs=rngs)
            self.l2 = nnx.Linear(16, SIZES[-1], rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(self.bn(jnp.tanh(self.l1(x)))))

    model = Net(nnx.Rngs(seed, dropout=seed + 1))
    ddp = jddp.nnx.DataParallel(model, optax.adam(1e-2), loss=jddp.Loss(model_state_sync="mean"),
                                loss_fn=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                                **options)
    return ddp, model


@pytest.mark.parametrize("options", [{}, {"place": jddp.ZeRO(stage=3)}], ids=["replicated",
                                                                              "zero3"])
def test_nnx_trainer_saves_restores_and_resumes_bit_identically(tmp_path, options):
    # The matrix cell "NNX x checkpoints" (issue 35 item 7): restore_or_init rejected a
    # jddp.nnx.DataParallel (it called ddp.init(params, model_state)), and a model state holding
    # nnx.Rngs keys (typed PRNG key arrays) failed restore's shape check.
    batches = _batches(6)
    ddp, model = _nnx_trainer(0, **options)
    uninterrupted = _run(ddp, ddp.init(), batches)

    mngr = ckpt.manager(tmp_path / "ckpt")
    ddp1, model1 = _nnx_trainer(0, **options)
    state = ckpt.restore_or_init(mngr, ddp1, model1)  # no checkpoint yet: ddp1.init(model1)
    assert int(state.step) == 0
    _assert_identical_keys(state, ddp1.init())
    ckpt.save(mngr, _run(ddp1, state, batches[:3]))

    # A fresh trainer around a model of other values: everything comes from the checkpoint.
    ddp2, model2 = _nnx_trainer(5, **options)
    restored = ckpt.restore_or_init(mngr, ddp2, model2)
    assert int(restored.step) == 3
    # restore (not restore_or_init) onto the NNX trainer's abstract state gives the same.
    _assert_identical_keys(ckpt.restore(mngr, ddp2.abstract_state()), restored)
    resumed = _run(ddp2, restored, batches[3:])  # (the step consumes its input state)
    _assert_identical_keys(resumed, uninterrupted)
    ddp2.update(model2, resumed)
    ddp.update(model, uninterrupted)
    _assert_identical_keys(nnx_state(model2), nnx_state(model))
    # The other spellings: the model it was built with, and the split states (the core's way).
    _assert_identical_keys(ckpt.restore_or_init(mngr, ddp2), restored_again := ckpt.restore(
        mngr, ddp2.abstract_state()))
    _assert_identical_keys(ckpt.restore_or_init(mngr, ddp2, *ddp2.split(model2)), restored_again)
    with pytest.raises(TypeError, match="pass the model alone"):
        ckpt.restore_or_init(mngr, ddp2, model2, {"bn": 1})


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


def _assert_identical_keys(a, b):
    """``_assert_identical``, with typed PRNG keys (``nnx.Rngs`` state) compared by key data."""
    def data(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    _assert_identical(jax.tree.map(data, a), jax.tree.map(data, b))


# Process 0 alone saves (docs/cluster.md once said "only process 0 should write checkpoints");
# process 1 goes on to its next steps.
SAVE_ON_MAIN_ONLY = """
import os, sys, time
import numpy as np
import jddp

jddp.initialize(timeout_s=60)
import jax.numpy as jnp, optax
import jddp.checkpoint as ckpt

mesh = jddp.data_mesh()
ddp = jddp.DataParallel(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), optax.sgd(0.1),
                        mesh=mesh)
mngr = ckpt.manager(os.path.join(sys.argv[1], "ckpt"))
state = ddp.init({"w": np.ones((5, 3), np.float32)})
for step in range(50):
    r = np.random.default_rng(step)
    batch = {"x": r.normal(size=(8, 5)).astype(np.float32),
             "y": r.normal(size=(8, 3)).astype(np.float32)}
    state, _ = ddp.step(state, jddp.shard_batch(batch, mesh))
    if step == 2 and jddp.is_main_process():
        print("SAVING AT", time.time(), flush=True)
        ckpt.save(mngr, state, barrier_timeout_s=float(sys.argv[2]))
"""


@pytest.mark.slow
def test_save_on_one_process_only_is_a_named_error_within_seconds(tmp_path):
    # Issue 35 item 5: this hung until the watchdog or --timeout, with no hint of the save.
    import textwrap
    import time

    from tests.launch_util import run_launcher

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SAVE_ON_MAIN_ONLY))
    rc, out, err, secs = run_launcher(
        ["-n", "2", "--devices-per-process", "2", "--grace", "2", "--timeout", "120",
         str(script), str(tmp_path), "3"], timeout=150)
    ended = time.time()
    assert rc == 1, (out[-2000:], err[-4000:])
    assert ("jddp.checkpoint.save(step=3) on process 0: process(es) 1 did not call it within "
            "3 s. jddp.checkpoint.save is collective: call it on every process") in err, err[-4000:]
    # The launcher's own line names the save too (the rank's exception line).
    assert ("[jddp-run] rank 0 exited with status 1 (RuntimeError: jddp.checkpoint.save(step=3) "
            "on process 0") in err, err[-3000:]
    saving = float(next(ln for ln in out.splitlines() if "SAVING AT" in ln).split()[-1])
    # 3 s of barrier, then the launcher's teardown (2 s grace), with room for a loaded machine.
    assert ended - saving < 25, (ended - saving, secs)


# ------------------------------------------------- owner rows against even pieces, mid-window


def _placed(shard, stage=2):
    """A trainer on 8 devices with the sharded accumulator, on test_owner's 16 equal matrices
    (enough for owner rows: every bucket row is one owner's leaves)."""
    from tests import test_owner as to

    return jddp.DataParallel(to._loss, optax.adam(1e-2), mesh=jddp.data_mesh(),
                             place=jddp.ZeRO(stage=stage, shard=shard),
                             accumulate=jddp.Accumulate(steps=2))


def _owner_batches(n):
    from tests import test_owner as to

    mesh = jddp.data_mesh()
    return [jddp.shard_batch(b, mesh) for b in to._batches(n, to.ROWS // 2)]


MIXED = r"saved with .*middle of a gradient accumulation window.*arranged differently"


def test_owner_mid_window_checkpoint_restores_into_owner_only(tmp_path):
    """Owner rows and even pieces have the same shapes: a mid-window checkpoint restores into the
    placement that saved it (and the window ends as if uninterrupted), is a named error in the
    other; at a window boundary it restores into either."""
    from tests import test_owner as to

    params, batches = to._params(), _owner_batches(3)
    a = _placed("owner")
    assert a.config.accumulate.shard
    mid = _run(a, a.init(params), batches[:1])
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, mid, step=1)
    boundary = _run(a, mid, batches[1:2])
    ckpt.save(mngr, boundary, step=2)
    boundary_params = _host(boundary.params)
    reference = _host(_run(a, boundary, batches[2:3]))  # the step donates its state
    restored = ckpt.restore(mngr, a.abstract_state(params), step=1)
    assert int(restored.update_state.count) == 1
    _assert_identical(_run(a, restored, batches[1:3]), reference)
    b = _placed("even")
    with pytest.raises(ValueError, match=MIXED + r".*shard=\"owner\"\).*window boundary"):
        ckpt.restore(mngr, b.abstract_state(params), step=1)
    with pytest.raises(ValueError, match=MIXED):
        ckpt.restore(mngr, b.init(params), step=1)  # a concrete target too
    restored = ckpt.restore(mngr, b.abstract_state(params), step=2)
    assert int(restored.update_state.count) == 0
    _assert_identical(restored.params, boundary_params)
    _run(b, restored, batches[2:3])  # and it trains


def test_even_mid_window_checkpoint_does_not_restore_into_owner(tmp_path):
    from tests import test_owner as to

    params, batches = to._params(), _owner_batches(1)
    a = _placed("even", stage=3)
    mngr = ckpt.manager(tmp_path / "c")
    ckpt.save(mngr, _run(a, a.init(params), batches), step=1)
    with pytest.raises(ValueError, match=MIXED + r".*Restore it with the placement that saved "
                                                 r"it \(jddp\.ZeRO\(stage=s\)\)"):
        ckpt.restore_or_init(mngr, _placed("owner", stage=3), params)
