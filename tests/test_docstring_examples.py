"""Every example in a public docstring (a literal block after ``::``, as the API pages show it)
runs, with jddp's ``DeprecationWarning`` as an error, so the API reference teaches the current
spelling. An example is a fragment of a script: ``SETUP`` gives each the names it assumes (a
model, a batch, a trainer), the smallest that make it run; ``NOT_RUN`` lists the few that cannot
run here, each with why."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
from test_doc_blocks import Block, _Zygote

import jddp

_BASE = """
import jax, jax.numpy as jnp, numpy as np, optax
import jddp, jddp.checkpoint
from flax import nnx
mesh = jddp.data_mesh()
def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
params = {"w": jnp.zeros((4, 1))}
x = np.random.default_rng(0).normal(size=(512, 4)).astype(np.float32)
batch = {"x": x[:16], "y": x[:16, :1]}
batches = [batch] * 6
source = jddp.data.ArraySource({"x": x, "y": x[:, :1]})
num_steps = 2
class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
    def __call__(self, x, rngs=None):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))
model = MLP(rngs=nnx.Rngs(0))
"""
#: What each example assumes, after _BASE.
SETUP: dict[str, str] = {
    "jddp.DataParallel": """
def loss_fn(params, batch):
    loss = jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    return loss, {"loss_x2": 2 * loss}
""",
    "jddp.evaluation.Evaluator": """
import types, flax.linen as nn
class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3)(x)
model = Net()
variables = model.init(jax.random.key(0), x[:1])
state = types.SimpleNamespace(params=variables["params"], model_state={})
x, y = x[:256], (x[:256, 0] > 0).astype(np.int32)
""",
    "jddp.checkpoint": "ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)\n",
    "jddp.data.Loader": """
def loss_fn(params, batch):
    return (batch["x"] @ params["w"] - batch["y"])[:, 0] ** 2
ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh, loss=jddp.Loss(weighted=True))
state = ddp.init(params)
saved = jddp.data.Loader(source, global_batch_size=256, mesh=mesh, seed=0).state()
""",
    "jddp.local_sgd": "",
    "jddp.nnx.DataParallel": "",
    "jddp.nnx.wrap": "",
    "jddp.perf.schedule": """
from jax.sharding import PartitionSpec as P
from jddp.perf.schedule import collectives, read_schedule
@jax.shard_map(mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
def step(p, b):
    return jax.lax.psum(jnp.sum(b @ p), "data")
params_like, batch_like = jnp.ones((4, 4)), jnp.ones((16, 4))
""",
    "jddp.perf.profile": """
import jddp.perf.profile
ddp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
state, DIR = ddp.init(params), "prof"
""",
}
#: Examples that do not run here, and why.
NOT_RUN: dict[str, str] = {
    "jddp.perf.costmodel.suggest_bucket_cap": "needs a measured profile (minutes of timing)",
    "jddp.perf.topologies": "shell commands (pip install), not Python",
}


def _public_modules(package: str) -> list[types.ModuleType]:
    pkg = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{package}.{n}") for n in names]


def _literal_blocks(doc: str) -> list[str]:
    """The literal blocks of a docstring: the indented lines after a line ending in ``::``."""
    lines, found, i = doc.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].rstrip().endswith("::"):
            i += 1
            continue
        base, j, body = len(lines[i]) - len(lines[i].lstrip()), i + 1, []
        while j < len(lines) and (not lines[j].strip()
                                  or len(lines[j]) - len(lines[j].lstrip()) > base):
            body.append(lines[j])
            j += 1
        found.append(textwrap.dedent("\n".join(body)).strip() + "\n")
        i = j
    return found


def examples() -> list[tuple[str, str]]:
    """``(object name, code)`` of every public docstring's examples, each object once."""
    out, seen = [], set()
    for module in [jddp, *_public_modules("jddp"), *_public_modules("jddp.perf")]:
        objs = [(module.__name__, module)]
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                continue
            objs.append((f"{module.__name__}.{name}", obj))
            if inspect.isclass(obj):
                objs += [(f"{module.__name__}.{name}.{k}", v) for k, v in vars(obj).items()
                         if not k.startswith("_") and (callable(v) or isinstance(v, property))]
        for name, obj in objs:
            doc = inspect.getdoc(obj)
            if doc and id(obj) not in seen:
                seen.add(id(obj))
                out += [(name, code) for code in _literal_blocks(doc)]
    return out


EXAMPLES = examples()


def test_every_docstring_example_is_run_or_says_why():
    names = {n for n, _ in EXAMPLES}
    assert {"jddp.DataParallel", "jddp.nnx.DataParallel", "jddp.evaluation.Evaluator"} <= names
    unknown = names - SETUP.keys() - NOT_RUN.keys()
    assert not unknown, f"docstring examples with no SETUP (or NOT_RUN reason): {unknown}"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """The examples run like the guides' blocks: each in a process forked from one parent that
    imported jddp once (``test_doc_blocks._Zygote``)."""
    z = _Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log")
    yield z
    z.close()


@pytest.mark.slow
@pytest.mark.parametrize("name,code", EXAMPLES, ids=[f"{n}-{i}" for i, (n, _) in
                                                     enumerate(EXAMPLES)])
def test_docstring_example_runs(name, code, tmp_path, zygote):
    if name in NOT_RUN:
        pytest.skip(f"{name}: {NOT_RUN[name]}")
    out = zygote.run(Block(name, 0, "python", _BASE + SETUP[name] + code), tmp_path)
    assert out.returncode == 0, f"{name} failed:\n{code}\n{out.stderr[-4000:]}"


def test_docstring_examples_fit_the_column():
    """The API pages show the examples in the same column as the guides' blocks."""
    from test_doc_blocks import COLUMNS

    wide = [f"{name}: {len(ln)} columns: {ln.strip()[:40]}" for name, code in EXAMPLES
            for ln in code.splitlines() if len(ln) > COLUMNS]
    assert not wide, "\n".join(wide)
