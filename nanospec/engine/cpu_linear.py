"""The engine's CPU linears: its decode steps multiply by oneDNN-prepacked copies of the weights.

Why: decode steps are small-M matmuls ([B*(k+1), D] x [D, N]); MKL re-packs the whole weight on every
call and may not pick its best kernels for these shapes. oneDNN's prepacked blocked layout (what
torch.compile / inductor use for CPU linears) avoids both (`bench.py --suite engine`). Same math,
another summation order (float32 rounding apart).

The decoder (models/decoder.py) builds plain nn.Linear layers; a Runner turns those of the model it
runs into `PackedLinear` (`prepack_linears`: the class changes, as FSDP2's fully_shard changes a
module's class, and the parameters and state_dict stay as they are). A PackedLinear is nn.Linear
wherever the engine is not: autograd (the trainer), no_grad, GPU, other dtypes. So a trainer that
shares its policy with the engine (fp32 rollouts) runs exactly the linears it built.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACK = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


class PackedLinear(nn.Linear):
    """nn.Linear that, under inference_mode on CPU in float32 (the engine's steps), multiplies by a
    prepacked copy of its weight. The copy is rebuilt when the weight changes: (data_ptr, _version)
    moves on any in-place write (LLM.load_weights) or storage swap.
    `keep_weight = False` (LLM.sleep level 2: an engine whose weights a trainer refills) frees the weight's
    storage once packed: the packed copy is then the only one, until LLM.load_weights restores it."""
    keep_weight = True

    def forward(self, x):
        w = self.weight
        if (not PACK or not torch.is_inference_mode_enabled() or not x.is_cpu or w.is_inference()
                or not w.dtype == x.dtype == torch.float32):   # (inference tensors have no _version)
            return F.linear(x, w, self.bias)
        pack = self.__dict__.get("_pack")
        key, stored = (w.data_ptr(), w._version), w.untyped_storage().nbytes() > 0   # not stored: freed once packed
        if pack is None or (stored and pack.key != key):
            if not stored:
                raise RuntimeError("the engine's weights were freed (LLM.sleep(2)): LLM.load_weights refills them")
            pack = self.__dict__["_pack"] = _Packed(key, w, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64))
            if not self.keep_weight:
                w.untyped_storage().resize_(0)
        return torch.ops.mkldnn._linear_pointwise.default(x, pack.weight, self.bias, "none", [], "")


class _Packed:
    """A packed weight + the key it was built for (keeps the source alive so data_ptr is not reused).
    deepcopy (quantize_policy) gives an empty slot: oneDNN's opaque tensors cannot be copied."""
    def __init__(self, key, source, weight):
        self.key, self.source, self.weight = key, source, weight

    def __deepcopy__(self, memo):
        return None


def prepack_linears(model: nn.Module) -> nn.Module:
    """Every plain nn.Linear of `model` becomes a PackedLinear (subclasses, e.g. a quantized layer, stay)."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = PackedLinear
    return model


def drop_packed_weights(model: nn.Module) -> None:
    """Free the prepacked copies (rebuilt on the next engine step). LLM.sleep calls it: a trainer that
    updates the weights the engine shares then holds one copy of them through its backward."""
    for m in model.modules():
        m.__dict__.pop("_pack", None)
