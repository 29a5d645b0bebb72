"""FSDP2 sharding of the policy (run.sharding: fsdp), after torchtitan's `parallelize`.

Replicated (run.sharding: none), every rank holds the whole policy, its gradients and both AdamW
moments: ~16 bytes per parameter in fp32. FSDP2 (`fully_shard` over a 1-D DeviceMesh of every rank)
keeps 1/world of each of them per rank; a layer's whole parameters exist only while it runs (one
all-gather before its forward and again before its backward, one reduce-scatter of its gradients).

    shard_policy      fully_shard each decoder layer, then the root (embeddings, final norm, lm_head);
                      GPU: bf16 compute, fp32 gradient reduction (MixedPrecisionPolicy); CPU: fp32
    clip_grad_norm_   the global norm over DTensor shards (its full_tensor is one all-reduce)
    full_weights      the policy's whole weights one tensor at a time, for the engine's weight sync
    training_state    this rank's shards of the policy and AdamW, for DCP checkpoints (checkpoint.py);
    load_training_state  and back, resharded to this world size
    state_bytes       the training state this rank holds (the `rank_train_state_gib` metric)

The trainer's contract does not change: each rank's loss is already scaled by the GLOBAL sequence /
token counts (loss.py), so gradients are SUMMED over ranks (divide factor 1), as the replicated
trainer's all_reduce(SUM) does. Every forward/backward is now a collective, so ranks must run the
same number of micro-batches (the trainer pads the shorter ranks with zero-weighted ones).
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from nanospec.rl import dist


def shard_policy(model: torch.nn.Module, activation_checkpointing: bool = False) -> torch.nn.Module:
    """Shard `model` (a decoder.CausalLM) in place over every rank -> the same module, now an FSDPModule.

    The root keeps its parameters gathered after forward (reshard_after_forward=False): the trainer
    calls `model.logits` on chunks of the hidden states outside forward (grpo.completion_logprobs), and
    the root's embedding / lm_head (tied or not) must stay whole until its backward has run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    dev = next(model.parameters()).device
    if not dist.is_dist():    # world 1 without torchrun: FSDP still wants a process group
        torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1,
                                             store=torch.distributed.HashStore(),
                                             device_id=dev if dev.type == "cuda" else None)
    mesh = init_device_mesh(dev.type, (dist.world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dev.type == "cuda"
          else MixedPrecisionPolicy())
    for layer in model.model.layers:
        if activation_checkpointing:   # the layer's forward, not a wrapper module: parameter names stay
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    # forward returns a view of its last activation; the trainer only reads from it (no in-place op)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPCausalLM\) returned a view tensor")
    for m in model.modules():
        if isinstance(m, FSDPModule):   # SUM, not the default mean: the losses carry the global scaling
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)   # a plain SUM (gloo has no PREMUL_SUM)
    return model


def clip_grad_norm_(params: list, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (its two halves), with the norm of sharded gradients made global."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class full_weights:
    """A state-dict view of a sharded model for `LLM.load_weights`: `items()` gathers one parameter at a
    time (`DTensor.full_tensor`, an all-gather; collective, so every rank iterates it), layer by layer
    in module order, and drops it once the engine has copied it. Extra peak memory: one whole tensor,
    never a whole model. Tied weights appear once (named_parameters de-duplicates them)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def items(self):
        for name, p in self.model.named_parameters():
            yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def training_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """{"model", "optimizer"}: this rank's shards, keyed by parameter name (DCP's format: checkpoints
    written at one world size load at another)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m, o = get_state_dict(model, opt)
    return {"model": m, "optimizer": o}


def load_training_state(model: torch.nn.Module, opt: torch.optim.Optimizer, load) -> None:
    """Fill the model's and optimizer's shards in place: `load(state)` (checkpoint.load_sharded) reads
    a checkpoint into the templates `training_state` gives, resharding to this world size."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    state = training_state(model, opt)     # (initialises AdamW's lazy state first: lr 0, zero grads)
    load(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    opt.zero_grad(set_to_none=True)


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of training state this rank holds: its parameters, gradients and optimizer state (local
    shards when sharded). Replicated fp32 AdamW: 16 per parameter; FSDP over W ranks: 16 / W."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    ts = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    ts += [local(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in ts)
