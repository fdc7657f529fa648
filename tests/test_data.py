"""jddp.data.Loader: exactly-once global batches, the same on every layout, resumable; its use in
training (weighted=True equals one device on the real rows), evaluation and checkpoints."""

from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jddp
import jddp.checkpoint as ckpt
from jddp.data import ArraySource, Loader


def _arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 6)).astype(np.float32),
            "y": rng.standard_normal(n).astype(np.float32),
            "id": np.arange(n, dtype=np.int32)}


class Counting:
    """A list-like source that records which examples were read (and from which thread)."""

    def __init__(self, arrays):
        self.src = ArraySource(arrays)
        self.reads: list[int] = []
        self.lock = threading.Lock()

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        with self.lock:
            self.reads.append(int(i))
        return self.src[i]


def _host(batch, mask):
    return jax.tree.map(np.asarray, batch), None if mask is None else np.asarray(mask)


def _meshes():
    devs = jax.devices()
    return {"1x8": jddp.data_mesh(),
            "2x4": jddp.data_mesh(hosts=2),
            "1dev": Mesh(np.array(devs[:1]), ("data",)),
            "4dev": Mesh(np.array(devs[4:]), ("data",))}


def test_every_example_once_per_epoch_wrapped_padding_and_the_same_batches_on_every_layout():
    data = _arrays(50)
    got = {}
    for name, mesh in _meshes().items():
        loader = Loader(ArraySource(data), global_batch_size=16, mesh=mesh, seed=3,
                        prefetch=0 if name == "1dev" else 2)
        assert len(loader) == 4
        got[name] = [_host(*next(loader)) for _ in range(8)]  # two epochs
        assert got[name][0][0]["x"].shape == (16, 6)
        loader.close()
    ref = got["1x8"]
    for epoch in range(2):
        batches = ref[4 * epoch:4 * epoch + 4]
        assert [m is None for _, m in batches] == [True, True, True, False]
        last, mask = batches[-1]
        assert mask.tolist() == [True] * 2 + [False] * 14  # 50 = 3 * 16 + 2
        # padding: the epoch's first examples again (DistributedSampler's), real inputs
        first = np.concatenate([b["id"] for b, _ in batches[:1]])
        assert last["id"][2:].tolist() == first[:14].tolist()
        np.testing.assert_array_equal(last["x"], data["x"][last["id"]])
        ids = np.concatenate([b["id"] if m is None else b["id"][m] for b, m in batches])
        assert sorted(ids.tolist()) == list(range(50))  # every example exactly once
        np.testing.assert_array_equal(ref[4 * epoch][0]["x"], data["x"][ref[4 * epoch][0]["id"]])
    assert ref[0][0]["id"].tolist() != ref[4][0]["id"].tolist()  # reshuffled per epoch
    for name, batches in got.items():  # the same global batches on 1, 4, 8 devices, 1 or 2 levels
        for (a, ma), (b, mb) in zip(ref, batches, strict=True):
            jax.tree.map(np.testing.assert_array_equal, a, b)
            assert (ma is None and mb is None) or ma.tolist() == mb.tolist(), name
    # drop_last: 3 full batches per epoch, no mask; no shuffle: index order
    plain = Loader(ArraySource(data), global_batch_size=16, shuffle=False, drop_last=True)
    assert len(plain) == 3
    b, m = next(plain)
    assert m is None and np.asarray(b["id"]).tolist() == list(range(16))


def test_each_device_gets_its_rows_and_only_they_are_read():
    """Every process reads only the rows of its devices: with 8 local devices all of them; the
    layout bookkeeping (which rows, in which order) is what the 2-process test relies on."""
    src = Counting(_arrays(40))
    loader = Loader(src, global_batch_size=16, mesh=jddp.data_mesh(hosts=2), prefetch=0)
    batch, _ = next(loader)
    assert loader.local_rows == ((0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12), (12, 14),
                                 (14, 16))
    for shard in batch["id"].addressable_shards:
        rows = shard.index[0].indices(16)
        np.testing.assert_array_equal(np.asarray(shard.data),
                                      loader.indices(0)[0][rows[0]:rows[1]])
    assert sorted(src.reads) == sorted(loader.indices(0)[0].tolist())


def test_state_restores_mid_epoch_at_the_boundary_and_rejects_another_data_set():
    data = _arrays(50)
    loader = Loader(ArraySource(data), global_batch_size=16, seed=7)
    stream = [_host(*next(loader)) for _ in range(10)]
    for at in (2, 4, 7):  # mid-epoch, an epoch boundary, mid-epoch of epoch 1
        other = Loader(ArraySource(data), global_batch_size=16, seed=7,
                       mesh=Mesh(np.array(jax.devices()[:2]), ("data",)))  # another layout
        probe = Loader(ArraySource(data), global_batch_size=16, seed=7)
        for _ in range(at):
            next(probe)
        state = json.loads(json.dumps(probe.state()))  # JSON-serialisable
        assert state["position"] == at and state["epoch"] == at // 4
        other.restore(state)
        for want in stream[at:at + 3]:
            got = _host(*next(other))
            jax.tree.map(np.testing.assert_array_equal, want[0], got[0])
        other.close()
        probe.close()
    with pytest.raises(ValueError, match="length: saved 50, this loader 51"):
        Loader(ArraySource(_arrays(51)), global_batch_size=16, seed=7).restore(state)
    with pytest.raises(ValueError, match="seed: saved 7, this loader 8"):
        Loader(ArraySource(data), global_batch_size=16, seed=8).restore(state)
    with pytest.raises(ValueError, match="global_batch_size: saved 16, this loader 32"):
        Loader(ArraySource(data), global_batch_size=32, seed=7).restore(state)
    with pytest.raises(ValueError, match="Not a jddp.data.Loader state"):
        loader.restore({"step": 3})


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match="ArraySource"):
        Loader({"x": np.ones((8, 2))}, global_batch_size=8)
    with pytest.raises(TypeError, match=r"support len\(source\) and source\[i\]"):
        Loader(iter(range(8)), global_batch_size=8)
    with pytest.raises(ValueError, match="does not divide over the 8 devices"):
        Loader(ArraySource(_arrays(40)), global_batch_size=12)
    with pytest.raises(ValueError, match="empty"):
        Loader([], global_batch_size=8)
    with pytest.raises(ValueError, match="not one full batch"):
        Loader(ArraySource(_arrays(5)), global_batch_size=8, drop_last=True)
    mixed = [{"x": np.zeros(3, np.float32)}] * 5 + [{"x": np.zeros(4, np.float32)}] * 11
    with pytest.raises(ValueError, match=r"Example \d+ of the source has leaf 0 of shape \(4,\)"):
        next(Loader(mixed, global_batch_size=16, shuffle=False))
    keys = [{"x": np.zeros(3)}] * 8 + [{"z": np.zeros(3)}] * 8
    loader = Loader(keys, global_batch_size=16, shuffle=False)  # read by the read-ahead thread
    with pytest.raises(ValueError, match="structure"):
        next(loader)
    with pytest.raises(ValueError, match="structure"):  # again, not a hang
        next(loader)


def test_read_workers_and_read_ahead_give_the_same_batches():
    data = _arrays(40)
    rows = [{k: v[i] for k, v in data.items()} for i in range(40)]  # per-example reads
    first = Loader(rows, global_batch_size=16, prefetch=0)
    want = [_host(*next(first)) for _ in range(6)]
    for kw in ({"workers": 3, "prefetch": 0}, {"workers": 3, "prefetch": 3}):
        loader = Loader(rows, global_batch_size=16, **kw)
        for w, g in zip(want, (_host(*next(loader)) for _ in range(6)), strict=True):
            jax.tree.map(np.testing.assert_array_equal, w[0], g[0])
        loader.close()


def test_grain_map_dataset_is_a_source():
    grain = pytest.importorskip("grain")
    data = _arrays(24)
    ds = grain.MapDataset.source(ArraySource(data)).map(lambda e: {**e, "x": e["x"] * 2})
    batch, mask = next(Loader(ds, global_batch_size=8, shuffle=False))
    assert mask is None
    np.testing.assert_array_equal(np.asarray(batch["x"]), data["x"][:8] * 2)


def _per_example(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return ((h @ params["w2"])[:, 0] - batch["y"]) ** 2


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (6, 16)) * 0.3, "b1": jnp.zeros(16),
            "w2": jax.random.normal(k2, (16, 1)) * 0.3}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_epoch_through_the_loader_equals_single_device_training(accumulate):
    """weighted=True + the loader's mask: one epoch (the short last batch included) equals plain
    optax on one device over the same real rows, to 1e-5. With accumulate_steps=2 each window of
    two micro-batches equals one single-device step on their real rows."""
    data = _arrays(45)  # 45 = 2 * 16 + 13: a short last batch
    loader = Loader(ArraySource(data), global_batch_size=16, seed=1,
                    accumulate_steps=accumulate)
    opt = optax.adam(1e-2)
    ddp = jddp.DataParallel(_per_example, opt, loss=jddp.Loss(weighted=True),
                            accumulate=jddp.Accumulate(steps=accumulate))
    state = ddp.init(_params())
    params, opt_state = _params(), opt.init(_params())
    rows = []
    for i in range(len(loader) + 1):  # one epoch and the first batch of the next
        batch, mask = next(loader)
        sync = loader.window_end if accumulate > 1 else None
        state, _ = ddp.step(state, batch, mask=mask, sync=sync)
        host, m = _host(batch, mask)
        rows.append(host["id"] if m is None else host["id"][m])
        if i % accumulate == accumulate - 1:
            ids = np.concatenate(rows)
            rows = []
            real = {k: v[ids] for k, v in data.items()}
            grads = jax.grad(lambda p, real=real: _per_example(p, real).mean())(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
    assert loader.position == 4 and int(state.step) == 4 // accumulate
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _class0_probability_after_unmasked_training(drop_last):
    """Issue 35's scenario: 20 examples, global batch 16, labels 1 or 2 (never 0), a non-weighted
    step fed ``batch, _ = next(loader)`` for 40 steps; the mean predicted probability of class 0
    over the data set."""
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((20, 4)).astype(np.float32),
            "y": rng.integers(1, 3, 20).astype(np.int32)}
    loader = Loader(ArraySource(data), global_batch_size=16, seed=0, drop_last=drop_last)

    def logits(p, x):
        return x @ p["w"] + p["b"]

    def loss_fn(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits(p, batch["x"]), batch["y"]).mean()

    ddp = jddp.DataParallel(loss_fn, optax.adam(0.05))
    state = ddp.init({"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)})
    for _ in range(40):
        batch, _ = next(loader)  # the mask dropped, as a non-weighted step requires
        state, _ = ddp.step(state, batch)
    loader.close()
    return float(jax.nn.softmax(logits(jax.device_get(state.params), data["x"]))[:, 0].mean())


def test_a_dropped_mask_trains_on_real_examples_not_on_zero_rows():
    """The short last batch is padded with real examples (DistributedSampler's wrap-around), so a
    non-weighted step that never sees the mask trains on no invented example. With zero rows (label
    0, input 0) class 0 reached a mean probability of 0.28 here; without the short batch 0.026."""
    wrapped = _class0_probability_after_unmasked_training(drop_last=False)
    dropped = _class0_probability_after_unmasked_training(drop_last=True)
    assert dropped < 0.05, dropped
    assert wrapped < 0.05 and abs(wrapped - dropped) < 0.02, (wrapped, dropped)


def test_accumulation_windows_save_only_at_their_boundary():
    loader = Loader(ArraySource(_arrays(64)), global_batch_size=8, accumulate_steps=3)
    next(loader)
    assert not loader.window_end
    with pytest.raises(RuntimeError, match="middle of an accumulation window"):
        loader.state()
    next(loader), next(loader)
    assert loader.window_end and loader.state()["position"] == 3


def test_evaluator_counts_every_real_example_once_through_a_loader():
    data = _arrays(45)
    w = np.float32(0.5)

    def eval_fn(v, batch):
        return {"count": jnp.ones(len(batch["y"])), "id": batch["id"].astype(jnp.float32),
                "y": batch["y"] * v}

    for mesh in (jddp.data_mesh(), jddp.data_mesh(hosts=2)):
        evaluate = jddp.evaluation.Evaluator(eval_fn, mesh=mesh)
        loader = Loader(ArraySource(data), global_batch_size=16, mesh=mesh, shuffle=False)
        for _ in range(2):  # epoch after epoch
            sums = evaluate(w, loader)
            assert sums["count"] == 45 and sums["id"] == sum(range(45))
            np.testing.assert_allclose(sums["y"], np.sum(data["y"].astype(np.float64)) * 0.5,
                                       rtol=1e-5)
    next(loader)
    with pytest.raises(ValueError, match="middle of an epoch"):
        evaluate(w, loader)
    with pytest.raises(ValueError, match="drop_last=True"):
        evaluate(w, Loader(ArraySource(data), global_batch_size=16, drop_last=True))
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(w, data)


def test_checkpoint_saves_and_restores_the_loader_with_the_state(tmp_path):
    data = _arrays(40)
    ddp = jddp.DataParallel(_per_example, optax.sgd(0.1), loss=jddp.Loss(weighted=True))

    def run(mngr, steps, loader):
        state = ckpt.restore_or_init(mngr, ddp, _params(), loader=loader)
        for step in range(int(state.step), steps):
            batch, mask = next(loader)
            state, _ = ddp.step(state, batch, mask=mask)
            ckpt.save_if_due(mngr, state, step=step + 1, loader=loader)
        ckpt.wait(mngr)
        return state

    ref = run(ckpt.manager(tmp_path / "ref", save_interval_steps=100), 7,
              Loader(ArraySource(data), global_batch_size=16))
    run(ckpt.manager(tmp_path / "c", save_interval_steps=4), 5,
        Loader(ArraySource(data), global_batch_size=16))  # saved at step 4
    loader = Loader(ArraySource(data), global_batch_size=16)
    resumed = run(ckpt.manager(tmp_path / "c", save_interval_steps=4), 7, loader)
    assert loader.position == 7
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="seed: saved 0, this loader 1"):
        ckpt.restore_or_init(ckpt.manager(tmp_path / "c"), ddp, _params(),
                             loader=Loader(ArraySource(data), global_batch_size=16, seed=1))
    plain = ckpt.manager(tmp_path / "plain")
    ckpt.save(plain, ddp.init(_params()))  # no loader item
    with pytest.raises(ValueError, match="holds no loader state"):
        ckpt.restore_or_init(plain, ddp, _params(), loader=loader)


def test_checkpoints_of_the_single_item_layout_still_restore(tmp_path):
    """Checkpoints written before the loader item existed (one orbax item) restore unchanged."""
    import orbax.checkpoint as ocp

    ddp = jddp.DataParallel(_per_example, optax.adam(0.1), loss=jddp.Loss(weighted=True))
    state = ddp.init(_params())
    state, _ = ddp.step(state, jddp.shard_batch({k: v[:16] for k, v in _arrays(16).items()},
                                                ddp.mesh))
    old = ocp.CheckpointManager(  # what jddp.checkpoint.manager() made before
        str(tmp_path), options=ocp.CheckpointManagerOptions(create=True),
        item_handlers=ocp.StandardCheckpointHandler())
    old.save(1, args=ocp.args.StandardSave(state), force=True)
    old.wait_until_finished()
    restored = ckpt.restore_or_init(ckpt.manager(tmp_path), ddp, _params())
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
