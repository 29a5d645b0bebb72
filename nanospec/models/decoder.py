"""A small decoder for HF Llama / Qwen2 / Qwen3 checkpoints, with attention over a paged KV cache.

Module names mirror transformers' (`model.layers.0.self_attn.o_proj.weight`, ...) except two fused
projections, as in vLLM: `qkv_proj` = [q_proj; k_proj; v_proj] and `gate_up_proj` = [gate_proj; up_proj]
(fewer, larger matmuls); loader.py concatenates / splits them so HF directories load and save as
before. Differences between the families are three flags:
    Llama : RMSNorm, RoPE, GQA, SiLU-gated MLP           (attention_bias usually False)
    Qwen2 : Llama + bias on q/k/v                         (attention_bias=True)
    Qwen3 : Llama + RMSNorm on each head of q and k       (qk_norm=True, explicit head_dim)

A plain model: training calls it with `kv=None` (causal attention over the input). An engine step
passes a `PagedKV` (engine/paged_attention.py), which the model binds once per forward and every
attention layer hands its rotated q, k, v to: the paged cache, its kernels and the engine's CPU
linears (engine/cpu_linear.py) live on the engine's side, so rollout and trainer share every weight
and the trainer never meets them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanospec.config import ARCHS

SUPPORTED = ARCHS


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype == self.weight.dtype == torch.float32:   # in place on temporaries; bitwise the same as below
            return (x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()).mul_(self.weight)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_table(n: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """[n, 2, hd]: cos and sin' of positions 0..n-1 for HF's rotate-half RoPE (same float ops as HF).

    rotate_half(x) * sin == roll(x, hd/2) * sin' with sin' = [-sin, sin] (a sign flip: exact), so one
    elementwise pass x * cos + roll(x) * sin' rotates q and k together (see `rope`)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    freqs = torch.arange(n, device=device).float()[:, None] * inv_freq               # [n, hd/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)


def rope(x, cos, sin):
    """x: [..., hd] rotated by position: x * cos + rotate_half(x) * sin (sin already sign-flipped)."""
    if x.dtype != torch.float32:
        return (x.float() * cos + x.float().roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.layer, self.a = layer, a
        if a.num_heads % a.num_kv_heads:
            raise ValueError(f"num_heads {a.num_heads} must be a multiple of num_kv_heads {a.num_kv_heads}")
        # fused q|k|v projection (as vLLM's qkv_proj): one matmul; loader.py maps HF's q/k/v_proj
        self.qkv_proj = nn.Linear(a.hidden_size, (a.num_heads + 2 * a.num_kv_heads) * a.head_dim,
                                  bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x, B: int, rotary, paged):
        """x [N, D] -> [N, D], N = B * Q (or an engine step's packed real tokens). paged: None (causal
        attention over x itself) or the engine step's paged cache (engine/paged_attention.StepKV)."""
        a = self.a
        N, Hq, Hkv, hd = x.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
        G = Hq // Hkv
        qkv = self.qkv_proj(x)                                                # [N, (Hq + 2 Hkv) hd]
        if a.qk_norm:
            q, k, v = qkv.split([Hq * hd, Hkv * hd, Hkv * hd], -1)
            q, k = self.q_norm(q.view(N, Hq, hd)), self.k_norm(k.view(N, Hkv, hd))
            qkv = torch.cat([q.view(N, -1), k.view(N, -1), v], -1)
        # RoPE on q and k in one pass: the row as G + 2 chunks of Hkv heads (q, then k, then v: cos 1, sin 0)
        qkv = rope(qkv.view(N, G + 2, Hkv, hd), *rotary)                      # [N, G+2, Hkv, hd]
        if paged is not None:     # an engine step: write K/V into the paged cache, attend over it
            return self.o_proj(paged.attend(self.layer, qkv))
        Q = N // B
        q = qkv[:, :G].reshape(B, Q, Hq, hd)                                  # head h = kv head h // G
        k, v = qkv[:, G].view(B, Q, Hkv, hd), qkv[:, G + 1].view(B, Q, Hkv, hd)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True).transpose(1, 2)
        return self.o_proj(out.reshape(N, Hq * hd))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)  # gate | up
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(a, layer)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, B, rotary, paged):
        x = x + self.self_attn(self.input_layernorm(x), B, rotary, paged)
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

    def forward(self, input_ids, positions=None, kv=None, features=None):
        """input_ids, positions: [B, Q] -> final hidden states [B, Q, D] (call `logits` on what you need).
        features: [N, D] per real token, only for a draft head (drafters/head.py: `embed`)."""
        a = self.args
        B, Q = input_ids.shape
        if positions is None:
            positions = torch.arange(Q, device=input_ids.device).expand_as(input_ids)
        # a ragged step (verify rows with and without drafts, prefill chunks) packs its real tokens:
        # projections and MLP then cost N real tokens, not B * Q padded ones
        index = kv.token_index if kv is not None else None
        flat_ids, flat_pos = input_ids.reshape(-1), positions.reshape(-1)
        if index is not None:
            flat_ids, flat_pos = flat_ids.index_select(0, index), flat_pos.index_select(0, index)
        x = self.embed(flat_ids, features)                                       # [N, D]
        rotary = self.rotary(flat_pos, Q)
        paged = None if kv is None else kv.bind(positions, a.num_kv_heads, a.num_heads, x.dtype, x.device)
        for layer in self.model.layers:
            x = layer(x, B, rotary, paged)
        x = self.model.norm(x)
        if index is not None:
            x = x.new_zeros(B * Q, x.shape[-1]).index_copy_(0, index, x)
        return x.view(B, Q, -1)

    def embed(self, ids, features=None):
        """[N] token ids -> [N, D] inputs of the first layer (a draft head mixes in the target's features)."""
        return self.model.embed_tokens(ids)

    def rotary(self, positions, width: int):
        """cos, sin' [N, G + 2, 1, hd] for the fused qkv row (chunks: G of q heads, k, v: cos 1, sin 0),
        looked up in a table built once per device (`rope_table`)."""
        a, dev = self.args, positions.device
        n = max(a.max_position_embeddings, width)   # kv=None may run past it, like HF
        table = self.__dict__.get("_rope")
        if table is None or table.device != dev or table.shape[0] < n:
            table = self.__dict__["_rope"] = rope_table(n, a.head_dim, a.rope_theta, dev)
        cs = table.index_select(0, positions.reshape(-1))                       # [N, 2, hd]
        G, N = a.num_heads // a.num_kv_heads, cs.shape[0]
        c = torch.ones(N, G + 2, 1, a.head_dim, device=dev)
        s = torch.zeros(N, G + 2, 1, a.head_dim, device=dev)
        c[:, :-1, 0], s[:, :-1, 0] = cs[:, None, 0], cs[:, None, 1]
        return c, s

    def logits(self, hidden):
        return self.lm_head(hidden).float()

    def new_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """[L, 2, (num_blocks + 1) * block_size, n_kv, hd], uninitialised; the extra block is the null
        block. The engine zeroes a block before its first use (engine/runner.Runner.zero_new_blocks).

        Indexed by slot like that, but stored head-major ([L, 2, n_kv, slots, hd] permuted): gathering a
        sequence's keys then yields [n_kv, B, C, hd] blocks that batched matmuls read without a copy."""
        a = self.args
        p = next(self.parameters())
        return torch.empty(a.num_layers, 2, a.num_kv_heads, (num_blocks + 1) * block_size, a.head_dim,
                           dtype=p.dtype, device=p.device).transpose(2, 3)
