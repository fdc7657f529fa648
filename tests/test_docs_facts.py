"""Facts the prose docs state, checked against the code (each was once wrong in the docs)."""

from __future__ import annotations

import pathlib

import optax
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
        ddp = jddp.DataParallel(mlp_loss, optax.adam(1e-3), zero_stage=stage, donate=False)
        sent[stage] = float(ddp.step(ddp.init(params), batch)[1]["comm_bytes"])
    assert sent[0] == sent[2] == sent[3] == 605_808
    assert sent[1] == 1.5 * sent[0] == 908_712
    text = (ROOT / "docs" / "sharded.md").read_text()
    assert "Stage 1 moves 1.5× stage\n0's" in text and "605,808 B" in text and "908,712 B" in text
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
    assert 'default is the core trainer\'s\n`model_state_sync="broadcast"`' in text
    assert 'default `model_state_sync="mean"`' not in text


def test_docstrings_use_the_option_names_that_exist():
    """skip_nonfinite is only the deprecated alias DataParallel maps to skip_not_finite."""
    wrong = [str(p) for p in (ROOT / "jddp").rglob("*.py") if "``skip_nonfinite``" in p.read_text()]
    assert not wrong, f"docs name skip_nonfinite (the option is skip_not_finite): {wrong}"
