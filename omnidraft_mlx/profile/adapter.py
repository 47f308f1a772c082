"""The drafter's adapter as a profile keeps it: which of the drafter's weights it is (LoRA
adapters of a rank and scale on its last blocks, or those blocks themselves), those weights,
and the adapters folded into the drafter for inference. learn/ trains it (distill.setup_trainable
from its settings); the profile saves the weights and, loading them, makes a fresh drafter take them.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from omnidraft_mlx.errors import OmniDraftError

SHAPE = ("lora_rank", "lora_scale", "layers")  # the training settings that decide the weights' shapes


def make_trainable(model, lora_rank: int, lora_scale: float, layers: int) -> None:
    """LoRA adapters (rank 0: plain weights) on the last `layers` blocks (-1: all); everything else frozen."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    n = len(model.model.layers) if layers < 0 else min(layers, len(model.model.layers))
    quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    if quantized and lora_rank == 0:
        raise OmniDraftError("a quantized drafter trains only through LoRA adapters: use --rank > 0")
    model.freeze()
    if lora_rank > 0:
        linear_to_lora_layers(model, n, {"rank": lora_rank, "scale": lora_scale, "dropout": 0.0})
    else:
        for layer in model.model.layers[len(model.model.layers) - n :]:
            layer.unfreeze()


def trainable_weights(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.trainable_parameters()))


def fuse_lora(model) -> None:
    """Fold LoRA adapters into plain linear layers (inference speed). Over a
    quantized layer they stay apart: re-quantizing would round the update away."""
    from mlx_lm.tuner.lora import LoRALinear

    fused = [
        (n, m.fuse())
        for n, m in model.named_modules()
        if isinstance(m, LoRALinear) and not isinstance(m.linear, nn.QuantizedLinear)
    ]
    if fused:
        model.update_modules(tree_unflatten(fused))
