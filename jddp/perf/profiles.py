"""Gradient profiles of two reference models, for cost-model predictions without the model."""

from __future__ import annotations

from typing import Any, NamedTuple

from jddp.perf.costmodel import ModelProfile

__all__ = [
    "Leaf",
    "bert_large_leaves",
    "bert_large_profile",
    "profile_from_leaves",
    "resnet50_leaves",
    "resnet50_profile",
]


class Leaf(NamedTuple):
    """One parameter tensor in forward (first-use) order.

    Attributes:
      name: a readable path.
      numel: number of elements.
      forward_flops: forward FLOPs per example of the operation that owns this tensor.
      input_grad: whether the backward also computes the gradient w.r.t. this op's input
        (False for the first layer, whose input is data).
    """

    name: str
    numel: int
    forward_flops: float = 0.0
    input_grad: bool = True


def resnet50_leaves(image_size: int = 224, num_classes: int = 1000) -> list[Leaf]:
    """ResNet-50's parameter tensors in forward order, FLOPs per image."""
    leaves: list[Leaf] = []

    def conv(name: str, cin: int, cout: int, k: int, out_hw: int, first: bool = False) -> None:
        flops = 2.0 * k * k * cin * cout * out_hw * out_hw
        leaves.append(Leaf(f"{name}.weight", k * k * cin * cout, flops, not first))

    def bn(name: str, c: int) -> None:
        leaves.append(Leaf(f"{name}.weight", c))
        leaves.append(Leaf(f"{name}.bias", c))

    hw = image_size // 2
    conv("conv1", 3, 64, 7, hw, first=True)
    bn("bn1", 64)
    hw //= 2  # max pool
    cin = 64
    for stage, (blocks, width, stride) in enumerate(
        ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)), start=1
    ):
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            s = stride if block == 0 else 1
            out_hw = hw // s
            conv(f"{prefix}.conv1", cin, width, 1, hw)
            bn(f"{prefix}.bn1", width)
            conv(f"{prefix}.conv2", width, width, 3, out_hw)  # stride on the 3x3 (ResNet v1.5)
            bn(f"{prefix}.bn2", width)
            conv(f"{prefix}.conv3", width, 4 * width, 1, out_hw)
            bn(f"{prefix}.bn3", 4 * width)
            if block == 0:
                conv(f"{prefix}.downsample.0", cin, 4 * width, 1, out_hw)
                bn(f"{prefix}.downsample.1", 4 * width)
            cin, hw = 4 * width, out_hw
    leaves.append(Leaf("fc.weight", cin * num_classes, 2.0 * cin * num_classes))
    leaves.append(Leaf("fc.bias", num_classes))
    return leaves


def bert_large_leaves(
    seq_len: int = 128,
    *,
    layers: int = 24,
    hidden: int = 1024,
    ffn: int = 4096,
    vocab: int = 30522,
    max_positions: int = 512,
) -> list[Leaf]:
    """BERT-large's parameter tensors (with MLM and NSP heads) in forward order, FLOPs per
    sequence of ``seq_len`` tokens."""
    t = float(seq_len)
    leaves = [
        Leaf("embeddings.word", vocab * hidden, 0.0, False),
        Leaf("embeddings.position", max_positions * hidden, 0.0, False),
        Leaf("embeddings.token_type", 2 * hidden, 0.0, False),
        Leaf("embeddings.norm.weight", hidden),
        Leaf("embeddings.norm.bias", hidden),
    ]

    def dense(name: str, cin: int, cout: int, extra_flops: float = 0.0) -> None:
        leaves.append(Leaf(f"{name}.weight", cin * cout, 2.0 * cin * cout * t + extra_flops))
        leaves.append(Leaf(f"{name}.bias", cout))

    for i in range(layers):
        p = f"encoder.{i}"
        dense(f"{p}.attention.query", hidden, hidden)
        dense(f"{p}.attention.key", hidden, hidden)
        dense(f"{p}.attention.value", hidden, hidden)
        # Scores (Q K^T) and the weighted sum (A V): 2 * 2 * seq^2 * hidden per sequence, counted
        # on the output projection that follows them.
        dense(f"{p}.attention.output", hidden, hidden, extra_flops=4.0 * t * t * hidden)
        leaves.append(Leaf(f"{p}.attention.norm.weight", hidden))
        leaves.append(Leaf(f"{p}.attention.norm.bias", hidden))
        dense(f"{p}.intermediate", hidden, ffn)
        dense(f"{p}.output", ffn, hidden)
        leaves.append(Leaf(f"{p}.output.norm.weight", hidden))
        leaves.append(Leaf(f"{p}.output.norm.bias", hidden))
    # Pooler and NSP head act on the first token only.
    leaves.append(Leaf("pooler.weight", hidden * hidden, 2.0 * hidden * hidden))
    leaves.append(Leaf("pooler.bias", hidden))
    dense("mlm.transform", hidden, hidden)
    leaves.append(Leaf("mlm.transform.norm.weight", hidden))
    leaves.append(Leaf("mlm.transform.norm.bias", hidden))
    # The decoder's weight is the (tied) word embedding; its matmul is counted on the decoder
    # bias, the first gradient the backward produces.
    leaves.append(Leaf("mlm.decoder.bias", vocab, 2.0 * hidden * vocab * t))
    leaves.append(Leaf("nsp.weight", hidden * 2, 4.0 * hidden))
    leaves.append(Leaf("nsp.bias", 2))
    return leaves


def profile_from_leaves(
    leaves: list[Leaf],
    *,
    batch_per_device: int,
    device_flops: float,
    bytes_per_grad: int = 4,
    optimizer_s: float = 0.0,
) -> ModelProfile:
    """A :class:`ModelProfile` (backward order) from forward-order leaves.

    Backward FLOPs are twice the forward FLOPs (gradients w.r.t. input and weights), or once for
    an op with no input gradient.

    Args:
      leaves: tensors in forward order.
      batch_per_device: examples per device per step.
      device_flops: achieved FLOP/s of one device for the whole step.
      bytes_per_grad: bytes per gradient element (4: float32 gradients, as with PyTorch AMP).
      optimizer_s: optimizer time per step.
    """
    back = leaves[::-1]
    fwd = [leaf.forward_flops * batch_per_device for leaf in back]
    bwd = [(2.0 if leaf.input_grad else 1.0) * f for leaf, f in zip(back, fwd, strict=True)]
    return ModelProfile(
        nbytes=tuple(leaf.numel * bytes_per_grad for leaf in back),
        backward_s=tuple(b / device_flops for b in bwd),
        forward_s=sum(fwd) / device_flops,
        optimizer_s=optimizer_s,
        names=tuple(leaf.name for leaf in back),
    )


def resnet50_profile(
    batch_per_device: int = 32, device_flops: float = 10e12, **kwargs: Any
) -> ModelProfile:
    """ResNet-50's profile at ``batch_per_device`` images and ``device_flops`` achieved FLOP/s."""
    return profile_from_leaves(
        resnet50_leaves(), batch_per_device=batch_per_device, device_flops=device_flops, **kwargs
    )


def bert_large_profile(
    batch_per_device: int = 16, device_flops: float = 10e12, seq_len: int = 128, **kwargs: Any
) -> ModelProfile:
    """BERT-large's profile at ``batch_per_device`` sequences of ``seq_len`` tokens."""
    return profile_from_leaves(
        bert_large_leaves(seq_len), batch_per_device=batch_per_device,
        device_flops=device_flops, **kwargs,
    )
