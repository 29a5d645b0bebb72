"""A small decoder for HF Llama / Qwen2 / Qwen3 checkpoints, with attention over a paged KV cache.

Module names mirror transformers' (`model.layers.0.self_attn.q_proj.weight`, ...) so HF state dicts
load and save without renaming. Differences between the families are three flags:
    Llama : RMSNorm, RoPE, GQA, SiLU-gated MLP           (attention_bias usually False)
    Qwen2 : Llama + bias on q/k/v                         (attention_bias=True)
    Qwen3 : Llama + RMSNorm on each head of q and k       (qk_norm=True, explicit head_dim)

One attention path serves prefill, 1-token decode and (k+1)-token verify, on a padded batch
`[B, Q]` of new tokens per sequence (see `PagedKV`). Training calls the same model with `kv=None`
(plain causal attention over the input), so rollout and trainer share every weight and kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = ("llama", "qwen2", "qwen3")


@dataclass
class ModelArgs:
    arch: str = "llama"
    vocab_size: int = 64
    hidden_size: int = 128
    intermediate_size: int = 344
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> "ModelArgs":
        arch = cfg.get("model_type")
        if arch not in SUPPORTED:
            raise ValueError(f"{where}: model_type {arch!r} is not supported; expected one of {SUPPORTED}")
        scaling = cfg.get("rope_scaling") or {}
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"{where}: rope_scaling {scaling} is not supported (only default RoPE)")
        need = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")
        heads = cfg["num_attention_heads"]
        return cls(
            arch=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", arch != "llama"),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"))

    def to_hf(self) -> dict:
        """The config.json transformers needs to load what `loader.save_model` writes."""
        name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[self.arch]
        cfg = dict(
            architectures=[f"{name}ForCausalLM"], model_type=self.arch, vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
            torch_dtype="float32")
        if self.arch == "llama":
            cfg["mlp_bias"] = False
        return cfg


@dataclass
class PagedKV:
    """Where the new tokens' K/V go and which cached positions each sequence attends to.

    The cache of each layer is a flat pool of slots `[num_slots, n_kv, hd]`; slot = block * bs + offset.
    The last block is a *null block*: padding rows write there and padded keys read from there, so every
    shape is static given (B, Q, C) — which is what lets a CUDA graph capture this same code.
    """
    cache: torch.Tensor          # [L, 2, num_slots, n_kv, hd]
    slot_mapping: torch.Tensor   # [B, Q]  slot of each new token (padding -> null slot)
    key_slots: torch.Tensor      # [B, C]  slot of key position j of each sequence (j < C)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions, head_dim: int, theta: float):
    """cos, sin [B, 1, Q, hd] for HF's rotate-half RoPE; computed once per forward, shared by layers."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions[:, None, :, None].float() * inv_freq                  # [B, 1, Q, hd/2]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def rope(x, cos, sin):
    """x: [B, H, Q, hd] rotated by position: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.layer, self.a = layer, a
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x, rotary, mask, kv: PagedKV | None):
        B, Q, _ = x.shape
        a = self.a
        q = self.q_proj(x).view(B, Q, a.num_heads, a.head_dim)
        k = self.k_proj(x).view(B, Q, a.num_kv_heads, a.head_dim)
        v = self.v_proj(x).view(B, Q, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q.transpose(1, 2), *rotary)                                 # [B, Hq, Q, hd]
        k = rope(k.transpose(1, 2), *rotary).transpose(1, 2)                 # [B, Q, Hkv, hd]
        if kv is None:  # training / reference: causal attention over the input itself
            out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
        else:
            k_cache, v_cache = kv.cache[self.layer]                          # [S, Hkv, hd] each
            k_cache.index_copy_(0, kv.slot_mapping.flatten(), k.reshape(B * Q, a.num_kv_heads, a.head_dim))
            v_cache.index_copy_(0, kv.slot_mapping.flatten(), v.reshape(B * Q, a.num_kv_heads, a.head_dim))
            keys = k_cache[kv.key_slots].transpose(1, 2)                     # [B, Hkv, C, hd]
            vals = v_cache[kv.key_slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, a.num_heads * a.head_dim))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(a, layer)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, rotary, mask, kv):
        x = x + self.self_attn(self.input_layernorm(x), rotary, mask, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions=None, kv: PagedKV | None = None):
        """input_ids, positions: [B, Q] -> final hidden states [B, Q, D] (call `logits` on what you need)."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        rotary = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta)
        mask = None
        if kv is not None:
            # a query at position p sees keys 0..p of its own sequence: causal within the new tokens,
            # the whole cached prefix. Padded queries (position 0) see key 0 only: finite, ignored.
            C = kv.key_slots.shape[1]
            mask = (torch.arange(C, device=x.device) <= positions[:, :, None]).unsqueeze(1)  # [B, 1, Q, C]
        for layer in self.model.layers:
            x = layer(x, rotary, mask, kv)
        return self.model.norm(x)

    def logits(self, hidden):
        return self.lm_head(hidden).float()

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype=None, device=None) -> torch.Tensor:
        """[L, 2, (num_blocks + 1) * block_size, n_kv, hd]; the extra block is the null block."""
        a = self.args
        p = self.model.embed_tokens.weight
        return torch.zeros(a.num_layers, 2, (num_blocks + 1) * block_size, a.num_kv_heads, a.head_dim,
                           dtype=dtype or p.dtype, device=device or p.device)
