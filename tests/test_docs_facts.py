"""Facts the prose docs state, checked against the code (each was once wrong in the docs)."""

from __future__ import annotations

import pathlib

import optax
import pytest
from flax import nnx

import jddp
from tests._models import mlp_loss, mlp_params, regression_batch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_sharded_stages_move_the_bytes_sharded_md_states():
    """sharded.md: stages 2 and 3 move stage 0's bytes, stage 1 1.5x (all-reduce + all-gather);
    the numbers quoted there are this model's."""
    params = mlp_params(0, [64, 256, 256, 16])
    batch = regression_batch(0, 16, 64, 16)
    sent = {}
    for stage in range(4):
        keep = dict(reshard_after_forward=False) if stage == 3 else {}
        ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-3),
                                place=jddp.ZeRO(stage=stage, **keep) if stage else jddp.Replicate(),
                                donate=False)
        sent[stage] = float(ddp.step(ddp.init(params), batch)[1]["comm_bytes"])
    ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-3), place=jddp.ZeRO(stage=3), donate=False)
    resharded = float(ddp.step(ddp.init(params), batch)[1]["comm_bytes"])
    # The gradients' bytes are equal at stages 0, 2 and 3 (keeping the gathered parameters); the
    # f32 loss rides on the last all-reduce (7 B) or reduce-scatter (as 8 rows: 28 B). Resharding
    # gathers the kernels of layers 2 and 3 again for the backward (layer 1's VJP needs no kernel).
    assert (sent[0], sent[2], sent[3]) == (605_815, 605_836, 605_836)
    assert resharded == 605_836 + (256 * 256 + 256 * 16) * 4 * 7 / 8 == 849_548
    assert sent[1] == 908_719 and sent[1] == pytest.approx(1.5 * sent[0], rel=1e-5)
    text = (ROOT / "docs" / "sharded.md").read_text()
    assert "Stage 1 moves 1.5× stage\n0's" in text
    assert all(f"{b} B" in text for b in ("605,815", "605,836", "908,719", "849,548"))
    assert "Every stage moves the same bytes" not in text


class _MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.l1(x)


def test_nnx_model_state_sync_default_is_the_one_migration_md_names():
    ddp = jddp.nnx.DataParallel(_MLP(nnx.Rngs(0)), optax.sgd(0.1),
                                loss_fn=lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean())
    assert ddp.model_state_sync == "broadcast"
    text = (ROOT / "docs" / "migration.md").read_text()
    assert ('default is the core trainer\'s\n`loss=jddp.Loss(model_state_sync="broadcast")`'
            in text)
    assert 'default `model_state_sync="mean"`' not in text


def test_docstrings_use_the_option_names_that_exist():
    """skip_nonfinite is only the deprecated alias DataParallel maps to skip_not_finite."""
    wrong = [str(p) for p in (ROOT / "jddp").rglob("*.py") if "``skip_nonfinite``" in p.read_text()]
    assert not wrong, f"docs name skip_nonfinite (the option is skip_not_finite): {wrong}"
