"""Attention over the paged KV cache: what a decoder layer does with its new K/V in an engine step.

The decoder (models/decoder.py) projects, normalises and rotates q, k, v; with a `PagedKV` (every
engine forward: prefill, 1-token decode, (k+1)-token verify) it hands them to `StepKV.attend`, which
writes the new K/V into the cache, gathers each sequence's keys through its block table and attends.
Training calls the model with kv=None and never reaches this file.
Two kernels: SDPA over the gathered keys (prefill, GPU), and on CPU, for steps with few new tokens
(Q <= SMALL_Q), two batched matmuls: for a handful of queries SDPA's flash kernel costs more than the
math here (fixed per-call overhead).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SMALL_Q = 16


@dataclass
class PagedKV:
    """Where the new tokens' K/V go and which cached positions each sequence attends to.

    The cache of each layer is a flat pool of slots `[num_slots, n_kv, hd]`; slot = block * bs + offset.
    The last block is a *null block*: padding rows write there and padded keys read from there, so every
    shape is static given (B, Q, C) — which is what lets a CUDA graph capture this same code.
    """
    cache: torch.Tensor          # [L, 2, num_slots, n_kv, hd], head-major storage (CausalLM.new_kv_cache)
    slot_mapping: torch.Tensor   # [B, Q]  slot of each new token (padding -> null slot)
    key_slots: torch.Tensor      # [B, C]  slot of key position j of each sequence (j < C)
    token_index: torch.Tensor | None = None   # [N] flat b * Q + i of the real tokens (None: all B * Q)

    def bind(self, positions, num_kv_heads: int, num_heads: int, dtype, device) -> "StepKV":
        """This step's view for every layer: flat cache slots, and the small-Q groups or SDPA's mask."""
        B, Q = positions.shape
        C, index = self.key_slots.shape[1], self.token_index
        caches = self.cache.permute(0, 1, 3, 2, 4)                             # [L, 2, Hkv, S, hd]
        if not caches.is_contiguous():   # flatten would copy and the layers' writes would be lost
            raise ValueError("PagedKV.cache must be laid out by CausalLM.new_kv_cache (head-major storage)")
        slots = self.slot_mapping.flatten()
        slots = slots if index is None else slots.index_select(0, index)
        step = StepKV(caches.flatten(1, 2), slots, self.key_slots.flatten(), B, C, Q, index)
        if Q <= SMALL_Q and device.type == "cpu":
            step.groups = query_groups(positions, self.key_slots, index, (num_kv_heads, num_heads // num_kv_heads), dtype)
        else:
            step.mask = attention_mask(positions, C, None)
        return step


@dataclass
class StepKV:
    """One step's paged cache as every layer's attention reads it (`PagedKV.bind`)."""
    caches: torch.Tensor                 # [L, 2 Hkv, S, hd]: PagedKV.cache, head-major, K heads then V heads
    slots: torch.Tensor                  # [N] cache slot of each new token
    key_slots: torch.Tensor              # [B * C] slot of key position j of each sequence
    B: int                               # sequences
    C: int                               # key positions per sequence
    Q: int                               # query positions per sequence (the padded width)
    token_index: torch.Tensor | None     # [N] flat b * Q + i of the real tokens (None: all B * Q)
    mask: torch.Tensor | None = None     # SDPA path: bool [B, 1, Q, C]
    groups: list | None = None           # small-Q CPU path: (rows | None for all, width, key slots, bias)

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [N, G + 2, Hkv, hd] (rotated; q heads, then k, then v) of this step's real tokens ->
        attention output [N, Hq * hd], after writing k and v into layer `layer`'s cache."""
        N, G, Hkv, hd = qkv.shape[0], qkv.shape[1] - 2, qkv.shape[2], qkv.shape[3]
        B, C, Q, index, Hq = self.B, self.C, self.Q, self.token_index, G * qkv.shape[2]
        if index is None:
            q = qkv[:, :G].reshape(B, Q, Hq, hd)                              # head h = kv head h // G
        else:   # packed tokens: only attention needs the padded [B, Q] layout
            q = qkv.new_zeros(B * Q, G, Hkv, hd).index_copy_(0, index, qkv[:, :G]).view(B, Q, Hq, hd)
        cache = self.caches[layer]                                           # [2 Hkv, S, hd]: k heads, v heads
        cache.index_copy_(1, self.slots, qkv[:, G:].reshape(N, 2 * Hkv, hd).transpose(0, 1))
        if self.groups is not None:    # fused small-Q path: batch (kv head, seq), rows (group, query)
            qv, out = q.view(B, Q, Hkv, G, hd), None
            for rows, w, key_slots, bias in self.groups:      # each row once, at its group's query width
                b = B if rows is None else len(rows)
                kvs = cache.index_select(1, key_slots).view(2, Hkv, b, C, hd)   # one gather, K and V
                qg = qv[:, :w] if rows is None else qv[rows, :w]                  # [b, w, Hkv, G, hd]
                qb = qg.permute(2, 0, 3, 1, 4).reshape(Hkv * b, G * w, hd)
                keys, vals = kvs[0].view(Hkv * b, C, hd), kvs[1].view(Hkv * b, C, hd)
                scores = torch.baddbmm(bias, qb, keys.transpose(1, 2), alpha=hd ** -0.5)   # [Hkv b, G w, C]
                og = torch.bmm(scores.softmax(-1), vals)                                  # [Hkv b, G w, hd]
                og = og.view(Hkv, b, G, w, hd).permute(1, 3, 0, 2, 4)                     # [b, w, Hkv, G, hd]
                if rows is None:
                    out = og
                else:
                    out = qv.new_zeros(qv.shape) if out is None else out
                    out[rows, :w] = og
        else:
            kvs = cache.index_select(1, self.key_slots).view(2, Hkv, B, C, hd)    # one gather, K and V
            keys, vals = kvs[0].transpose(0, 1), kvs[1].transpose(0, 1)              # [B, Hkv, C, hd]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=self.mask,
                                                 enable_gqa=True).transpose(1, 2)
        out = out.reshape(B * Q, Hq * hd)
        return out if index is None else out.index_select(0, index)


def attention_mask(positions, C: int, fused_shape: tuple | None, dtype=torch.float32):
    """Key j is visible to a query at position p iff j <= p: causal within the new tokens, the whole
    cached prefix. Padded queries (position 0) see key 0 only: finite, ignored.
    -> bool [B, 1, Q, C] for SDPA, or (fused_shape = (n_kv, groups)) an additive 0/-inf bias laid out
    like the fused decode scores [n_kv * B, groups * Q, C], built once and shared by every layer."""
    keep = torch.arange(C, device=positions.device) <= positions[:, :, None]              # [B, Q, C]
    if fused_shape is None:
        return keep.unsqueeze(1)
    Hkv, G = fused_shape
    B, Q = positions.shape
    bias = torch.where(keep, 0.0, float("-inf")).to(dtype)                                  # [B, Q, C]
    return bias[None, :, None].expand(Hkv, B, G, Q, C).reshape(Hkv * B, G * Q, C)


def query_groups(positions, key_slots, index, fused: tuple, dtype) -> list:
    """The small-Q attention's row groups: (rows, query width, their key slots, their bias). A ragged
    verify (a few rows with drafts) would pad every row's queries to the widest: on CPU attention
    costs B * Q * C, so rows with one new token attend alone at width 1 and only the others at Q."""
    B, Q = positions.shape
    C = key_slots.shape[1]
    if index is not None and Q > 1:
        lens = torch.bincount(torch.div(index, Q, rounding_mode="floor"), minlength=B)  # [B] real tokens
        single = torch.nonzero(lens == 1).flatten()
        if len(single):          # else every row has several tokens: one group, no gather by row
            return [(rows, w, key_slots[rows].flatten(), attention_mask(positions[rows, :w], C, fused, dtype))
                    for rows, w in ((single, 1), (torch.nonzero(lens > 1).flatten(), Q))]
    return [(None, Q, key_slots.flatten(), attention_mask(positions, C, fused, dtype))]
