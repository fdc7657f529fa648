"""The migration guide (docs/migration.md) in code: old train steps and their jddp versions agree.

Each version trains the same Linen MLP with the same optax optimizer on the same random global
batches for STEPS steps. Old versions: ``jax.pmap`` + ``lax.pmean(grads)``, and ``jit`` with
``NamedSharding`` (GSPMD). New versions: ``jddp.value_and_grad`` inside the same ``pmap`` (the
drop-in), and ``jddp.DataParallel``. All are the same mean-gradient step, so float32 params agree to
summation-order noise; we assert rtol/atol 1e-5 after 5 Adam steps.

The old keywords themselves live only in migration tests: here, the checks that no message of
jddp recommends one and that a doc block using one fails.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils
from flax import linen as nn
from flax.training import train_state
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_doc_blocks import Block, _Zygote

import jddp

STEPS = 5
TOL = dict(rtol=1e-5, atol=1e-5)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(4)(x)


model = MLP()


def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def make_data(n_steps=STEPS, size=64, seed=0):
    # Labels from a random linear teacher, so that the loss falls and the runs visibly train.
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(10, 4))
    data = []
    for _ in range(n_steps):
        x = rng.normal(size=(size, 10)).astype(np.float32)
        data.append({"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)})
    return data


def init_params():
    return model.init(jax.random.key(0), jnp.zeros((1, 10)))["params"]


tx = optax.adam(1e-2)


# ---- old: pmap + lax.pmean ---------------------------------------------------------------------

def train_pmap_old(data):
    state = train_state.TrainState.create(apply_fn=model.apply, params=init_params(), tx=tx)
    state = jax_utils.replicate(state)
    n = jax.local_device_count()

    @functools.partial(jax.pmap, axis_name="batch")
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        grads = lax.pmean(grads, axis_name="batch")
        loss = lax.pmean(loss, axis_name="batch")
        return state.apply_gradients(grads=grads), loss

    losses = []
    for batch in data:
        batch = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        state, loss = train_step(state, batch)
        losses.append(float(loss[0]))
    return jax_utils.unreplicate(state).params, losses


# ---- new (drop-in): pmap + jddp.value_and_grad ---------------------------------------------------

def train_pmap_jddp(data):
    state = train_state.TrainState.create(apply_fn=model.apply, params=init_params(), tx=tx)
    state = jax_utils.replicate(state)
    n = jax.local_device_count()

    @functools.partial(jax.pmap, axis_name="batch")
    def train_step(state, batch):
        loss, grads = jddp.value_and_grad(loss_fn, axis_name="batch")(state.params, batch)
        loss = lax.pmean(loss, axis_name="batch")
        return state.apply_gradients(grads=grads), loss

    losses = []
    for batch in data:
        batch = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        state, loss = train_step(state, batch)
        losses.append(float(loss[0]))
    return jax_utils.unreplicate(state).params, losses


# ---- old: jit + NamedSharding --------------------------------------------------------------------

def train_sharded_jit_old(data):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in data:
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


# ---- new: jddp.DataParallel ----------------------------------------------------------------------

def train_data_parallel(data):
    ddp = jddp.DataParallel(loss_fn, tx, mesh=jddp.data_mesh())
    state = ddp.init(init_params())
    losses = []
    for batch in data:
        state, metrics = ddp.step(state, batch)
        losses.append(float(metrics["loss"]))
    return state.params, losses


def assert_trees_close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL), a, b)


def test_all_versions_agree():
    data = make_data()
    results = {
        "pmap_old": train_pmap_old(data),
        "pmap_jddp": train_pmap_jddp(data),
        "sharded_jit_old": train_sharded_jit_old(data),
        "data_parallel": train_data_parallel(data),
    }
    ref_params, ref_losses = results["sharded_jit_old"]
    # The runs actually trained (not a no-op agreement).
    assert ref_losses[-1] < ref_losses[0]
    for name, (params, losses) in results.items():
        np.testing.assert_allclose(losses, ref_losses, **TOL, err_msg=name)
        assert_trees_close(params, ref_params)


def test_value_and_grad_inside_pmap_is_one_mean():
    """Inside pmap, jddp.value_and_grad returns the mean gradient, not N times it."""
    data = make_data(n_steps=1)[0]
    params = init_params()
    n = jax.local_device_count()
    ref = jax.grad(loss_fn)(params, data)
    sharded = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), data)
    grads = jax.pmap(
        lambda p, b: jddp.value_and_grad(loss_fn, axis_name="b", cap_mb=0.01,
                                         first_mb=0.005)(p, b)[1],
        axis_name="b",
    )(jax_utils.replicate(params), sharded)
    for i in range(n):
        assert_trees_close(jax.tree.map(lambda g, i=i: g[i], grads), ref)


# ------------------------------------------------------------------ Part 1: the PyTorch mapping

_DDP_CONCEPTS = (
    "init_process_group", "torchrun", "DistributedSampler", "set_epoch", "DDP(model",
    "bucket_cap_mb", "no_sync", "fp16_compress_hook", "powerSGD_hook", "find_unused_parameters",
    "static_graph", "broadcast_buffers", "SyncBatchNorm", "join", "gradient_as_bucket_view",
    "torch.save", "dist.barrier", "ZeroRedundancyOptimizer", "FSDP", "GradScaler",
    "clip_grad_norm_", "autocast",
)


def _ddp_rows():
    """``(torch, jddp, difference)`` of each row of migration.md's Part 1 table."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "migration.md").read_text()
    part1 = text[text.index("## Part 1"):text.index("## Part 2")]
    rows = [line for line in part1.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[1:]]
    assert all(len(c) == 3 for c in cells), [c for c in cells if len(c) != 3]
    return cells


def test_migration_maps_every_ddp_concept_to_a_jddp_spelling_that_exists():
    """Issue 35: docs/migration.md was not a PyTorch-DDP mapping. Every DDP concept a user brings
    has a row, and every ``jddp.*`` name in its jddp column resolves."""
    import importlib
    import re

    rows = _ddp_rows()
    for concept in _DDP_CONCEPTS:
        assert any(concept in torch for torch, _, _ in rows), f"no row for {concept}"
    names = {m for _, spelled, _ in rows for m in re.findall(r"jddp(?:\.\w+)+", spelled)}
    assert len(names) >= 14
    for name in sorted(names):
        parts = name.split(".")
        obj = importlib.import_module(parts[0])
        for i, attr in enumerate(parts[1:], 1):
            if not hasattr(obj, attr):  # a submodule not imported by its parent
                obj = importlib.import_module(".".join(parts[:i + 1]))
            else:
                obj = getattr(obj, attr)
        assert obj is not None, name


def test_the_keywords_the_mapping_names_are_accepted():
    """The DataParallel keywords of the jddp column, in the policies' spelling, construct a
    trainer without a DeprecationWarning (the column shows the current spelling)."""
    import warnings

    import jddp.precision

    two_level = jddp.data_mesh(hosts=2)
    cases = [
        {"reduce": jddp.Buckets(cap_mb=25)}, {"reduce": jddp.Buckets(cap_mb="model")},
        {"accumulate": jddp.Accumulate(steps=4)}, {"accumulate": jddp.Accumulate(microbatches=2)},
        {"reduce": jddp.Buckets(hook=jddp.fp16_compress())},
        {"reduce": jddp.Buckets(hook=jddp.bf16_compress())},
        {"reduce": jddp.Buckets(hook=jddp.powersgd(rank=1, start_iter=1000,
                                                   min_compression_rate=2.0))},
        {"reduce": jddp.Buckets(keep_unused=True)},
        {"loss": jddp.Loss(model_state_sync="broadcast")}, {"place": jddp.ZeRO(stage=1)},
        {"place": jddp.ZeRO(stage=2)}, {"place": jddp.ZeRO(stage=3, reshard_after_forward=True)},
        {"place": jddp.ZeRO(stage=3, hybrid=True), "mesh": two_level},
        {"reduce": jddp.Buckets(hook=jddp.hooks.hierarchical(inner=jddp.bf16_compress())),
         "mesh": two_level},
        {"reduce": jddp.Buckets(hook=jddp.hooks.int8_compress())},
        {"loss": jddp.Loss(weighted=True)}, {"loss": jddp.Loss(rng=True)},
        {"verify_every": 10},
        {"loss_scale": jddp.precision.DynamicScale()}, {"loss_scale": jddp.SkipNotFinite()},
        {"precision": jddp.precision.MixedPrecision(param_dtype=jnp.bfloat16,
                                                    reduce_dtype=jnp.float32)},
    ]
    for kw in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            jddp.DataParallel(lambda p, b, *rng: jnp.sum(p["w"]), optax.adamw(1e-3), **kw)

# --- 9. no message recommends a deprecated keyword --------------------------------------------


def _message_strings(tree):
    """``(line, text)`` of every string literal that is not a docstring (f-strings with their
    fields as ``{}``)."""
    import ast

    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inner.update(id(v) for v in node.values)
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}"
                                       for v in node.values)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docs and id(node) not in inner):
            yield node.lineno, node.value


def _call_around(text, i):
    """The name of the call whose parentheses hold position ``i`` of ``text`` (or None)."""
    import re

    depth = 0
    for j in range(i - 1, -1, -1):
        if text[j] == ")":
            depth += 1
        elif text[j] == "(":
            if depth == 0:
                m = re.search(r"([\w.]+)\s*$", text[:j])
                return m.group(1) if m else ""
            depth -= 1
    return None


def _recommends_old_keyword(text, start, keyword):
    import re

    around = _call_around(text, start)
    if around is not None:
        return around.endswith("DataParallel")
    # Outside any call: "pass has_aux=True", "build the DataParallel with rng=True".
    return re.search(r"\b(pass|with|use|set|give)\s+$", text[:start]) is not None


def test_no_message_recommends_a_deprecated_keyword():
    import ast
    import pathlib
    import re

    from jddp._src.api.deprecated import OWNERS

    root = pathlib.Path(jddp.__file__).parent
    pattern = re.compile(r"\b(" + "|".join(sorted(OWNERS)) + r")=")
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "deprecated.py":  # the deprecation machinery names them on purpose
            continue
        for line, text in _message_strings(ast.parse(path.read_text())):
            for m in pattern.finditer(text):
                if _recommends_old_keyword(text, m.start(), m.group(1)):
                    shown = text[max(0, m.start() - 40):m.end() + 20]
                    found.append(f"{path.relative_to(root)}:{line}: ...{shown}...")
    assert not found, "messages that recommend a deprecated keyword:\n" + "\n".join(found)


def test_the_old_keyword_scanner_sees_the_old_spellings():
    # The scanner flags what the issue found, and not the new spellings of the same names.
    text = "or return (loss, aux) and pass has_aux=True."
    assert _recommends_old_keyword(text, text.index("has_aux="), "has_aux")
    text = "keys: build the DataParallel with rng=True and pass"
    assert _recommends_old_keyword(text, text.index("rng="), "rng")
    text = "use jddp.DataParallel(zero_stage=2)"
    assert _recommends_old_keyword(text, text.index("zero_stage="), "zero_stage")
    text = "pass loss=jddp.Loss(has_aux=True)"
    assert not _recommends_old_keyword(text, text.index("has_aux="), "has_aux")


# --- the docs' blocks run with jddp's deprecations as errors (tests/test_doc_blocks.py) ---------


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """The doc blocks' runner (``test_doc_blocks._Zygote``): processes forked from one parent."""
    z = _Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield z
    z.close()


def test_a_run_fails_on_a_jddp_deprecation(tmp_path, zygote):
    """The net under every block: an old keyword in a block fails it."""
    code = ("import jax.numpy as jnp, optax, jddp\n"
            "jddp.DataParallel(lambda p, b: jnp.sum(p), optax.sgd(0.1), zero_stage=1)\n")
    out = zygote.run(Block("x.md", 1, "python", code), tmp_path)
    assert out.returncode != 0 and "DeprecationWarning" in out.stderr, out.stderr[-2000:]
    assert "zero_stage" in out.stderr
