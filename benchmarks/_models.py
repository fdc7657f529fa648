"""The models benchmarks/peers.py runs: an MLP, a conv net, a SyncBN ResNet-18 port, a small LM.

Each is a :class:`BenchModel`: host (NumPy) params, model state and a global batch, and a loss
factory ``loss(axis_name)`` whose loss is ``f(params, model_state, batch) -> (loss, new_state)``
(``new_state`` is ``None`` for stateless models). ``axis_name`` is the name the model's
cross-replica BatchNorm averages over (``None`` in jit's global view, where the batch statistics
are global anyway, and in the step without communication).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np


class BenchModel(NamedTuple):
    """One benchmark model.

    Attributes:
      name: row label.
      params: host params.
      model_state: host model state (``None`` for stateless models).
      batch: host global batch.
      loss: ``loss(axis_name) -> f(params, model_state, batch) -> (loss, new_model_state)``.
      description: size and shape, for the table.
    """

    name: str
    params: Any
    model_state: Any
    batch: dict
    loss: Callable[[Any], Callable[..., Any]]
    description: str


def _count(tree: Any) -> int:
    import jax

    return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


def mlp(batch: int = 256, width: int = 1200, depth: int = 8) -> BenchModel:
    """The issue's 11.5M-parameter MLP (8 tanh layers of 1200), mean squared error."""
    from benchmarks._mlp import mlp_loss, mlp_params

    rng = np.random.default_rng(0)
    params = mlp_params(width, depth)
    data = {"x": rng.normal(size=(batch, width)).astype(np.float32),
            "y": rng.normal(size=(batch, width)).astype(np.float32)}

    def loss(axis_name: Any) -> Callable[..., Any]:
        return lambda p, ms, b: (mlp_loss(p, b), None)

    return BenchModel("MLP", params, None, data, loss,
                      f"{_count(params) / 1e6:.1f}M params, batch {batch}")


def _classify(logits: Any, labels: Any) -> Any:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _images(batch: int, size: int, classes: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(batch, size, size, 3)).astype(np.float32),
            "y": rng.integers(0, classes, size=(batch,)).astype(np.int32)}


def convnet(batch: int = 64) -> BenchModel:
    """A 3.2M-parameter conv net on 32x32 images: three 3x3 convs, two pools, two dense layers."""
    import flax.linen as nn
    import jax

    class ConvNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.relu(nn.Conv(64, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Conv(128, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
            x = x.reshape(x.shape[0], -1)
            x = nn.relu(nn.Dense(384)(x))
            return nn.Dense(10)(x)

    model = ConvNet()
    data = _images(batch, 32, 10)
    params = jax.device_get(model.init(jax.random.key(0), data["x"][:1])["params"])

    def loss(axis_name: Any) -> Callable[..., Any]:
        return lambda p, ms, b: (_classify(model.apply({"params": p}, b["x"]), b["y"]), None)

    return BenchModel("conv net", params, None, data, loss,
                      f"{_count(params) / 1e6:.1f}M params, batch {batch}")


def resnet18(batch: int = 64, width: int = 8, size: int = 32) -> BenchModel:
    """Flax's ImageNet ResNet-18 (examples/imagenet/models.py), ``num_filters=width``, SyncBN.

    The stem, the four stages of two basic blocks with projection shortcuts, and the BatchNorm
    placement (zero-initialised scale on each block's last norm) follow Flax's example; images
    are ``size`` x ``size`` instead of 224 x 224 to keep a CPU step short.
    """
    import functools

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Block(nn.Module):
        filters: int
        strides: tuple[int, int]
        norm: Any

        @nn.compact
        def __call__(self, x):
            residual = x
            y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)
            y = nn.relu(self.norm()(y))
            y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
            y = self.norm(scale_init=nn.initializers.zeros_init())(y)
            if residual.shape != y.shape:
                residual = nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(residual)
                residual = self.norm()(residual)
            return nn.relu(residual + y)

    class ResNet(nn.Module):
        axis_name: Any = None

        @nn.compact
        def __call__(self, x, train: bool = True):
            norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                     epsilon=1e-5, axis_name=self.axis_name)
            x = nn.Conv(width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False)(x)
            x = nn.relu(norm()(x))
            x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
            for i, blocks in enumerate((2, 2, 2, 2)):
                for j in range(blocks):
                    strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                    x = Block(width * 2**i, strides, norm)(x)
            x = jnp.mean(x, axis=(1, 2))
            return nn.Dense(10)(x)

    data = _images(batch, size, 10)
    variables = jax.device_get(ResNet().init(jax.random.key(0), data["x"][:2]))

    def loss(axis_name: Any) -> Callable[..., Any]:
        model = ResNet(axis_name=axis_name)

        def f(p, ms, b):
            logits, new = model.apply({"params": p, **ms}, b["x"], mutable=["batch_stats"])
            return _classify(logits, b["y"]), new

        return f

    return BenchModel("ResNet-18 (width 8, SyncBN)", variables["params"],
                      {"batch_stats": variables["batch_stats"]}, data, loss,
                      f"{_count(variables['params']) / 1e6:.2f}M params, batch {batch}, "
                      f"{size}x{size}")


def transformer_lm(batch: int = 32, seq: int = 64, vocab: int = 512, dim: int = 128,
                   layers: int = 2, heads: int = 4) -> BenchModel:
    """A small decoder-only Transformer LM (pre-norm blocks, causal attention, tied nothing)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, dim)(tokens)
            x = x + self.param("pos", nn.initializers.normal(0.02), (seq, dim))
            mask = nn.make_causal_mask(tokens)
            for _ in range(layers):
                h = nn.LayerNorm()(x)
                x = x + nn.MultiHeadDotProductAttention(heads)(h, h, mask=mask)
                h = nn.LayerNorm()(x)
                x = x + nn.Dense(dim)(nn.gelu(nn.Dense(4 * dim)(h)))
            return nn.Dense(vocab)(nn.LayerNorm()(x))

    model = LM()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)
    data = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    params = jax.device_get(model.init(jax.random.key(0), data["x"][:1])["params"])

    def loss(axis_name: Any) -> Callable[..., Any]:
        def f(p, ms, b):
            logits = model.apply({"params": p}, b["x"]).astype(jnp.float32)
            return _classify(logits, b["y"]), None

        return f

    return BenchModel("Transformer LM", params, None, data, loss,
                      f"{_count(params) / 1e6:.1f}M params, batch {batch} x {seq} tokens")


MODELS: dict[str, Callable[[], BenchModel]] = {
    "mlp": mlp, "convnet": convnet, "resnet": resnet18, "lm": transformer_lm,
}
