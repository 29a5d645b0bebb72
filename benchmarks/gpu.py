"""GPU suite: CUDA-graph decode vs eager, and n-gram speculation vs AR with graphs.

Model: a random Qwen2-0.5B-shaped decoder (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
vocab 151936, tied embeddings) built directly in bf16 on the GPU, so nothing is downloaded. The
embedding is drawn with std 0.02 (HF's initializer_range) instead of nn.Embedding's N(0, 1), which
would make the tied head just repeat the last token. Greedy, ignore_eos, prefix caching off (every
repeat prefills the same work); tokens/s = completion tokens / wall time of one generate() call,
prefill included, median over repeats. `speedup` is against eager AR at the same batch and prompts.
same_as_ref / prefix_as_ref compare greedy tokens with the reference (graphs: eager; graphs+ngram:
graphs AR in bf16, eager AR in the fp32 rows).
"""
from __future__ import annotations

import statistics
import time

import torch

from nanospec.engine.cuda_graphs import kv_blocks_for_memory
from nanospec.engine.llm import LLM
from nanospec.models.decoder import CausalLM, ModelArgs
from nanospec.engine.sequence import SamplingParams

QWEN2_05B = dict(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, head_dim=64, attention_bias=True, tie_word_embeddings=True,
                 max_position_embeddings=4096, rope_theta=1e6)
MAX_LEN, BLOCK = 512, 16


def build_model() -> CausalLM:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CausalLM(ModelArgs(**QWEN2_05B))
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.02)
    return model.to(torch.bfloat16).eval()


def timed_generate(model, prompts, graphs: bool, max_tokens: int, reps: int, spec=None):
    """-> (median tokens/s, token ids, engine summary) for one engine configuration."""
    llm = LLM(model, dtype=None, device="cuda", max_num_seqs=max(len(prompts), 1), block_size=BLOCK,
              max_model_len=MAX_LEN, num_kv_blocks=len(prompts) * (MAX_LEN // BLOCK) + 8,
              use_cuda_graphs=graphs, speculative=spec, prefix_caching=False)
    if graphs:                                 # capture decode (Q=1) and every verify width up front
        llm.runner.capture(range(1, 2 + (spec["num_draft_tokens"] if spec else 0)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    rates = []
    for _ in range(reps):                      # warm-up above: graphs captured, cuBLAS handles made
        llm.reset_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return statistics.median(rates), [o.token_ids for o in outs], llm.summary()


def agreement(a, b) -> tuple[float, float]:
    """(fraction of identical completions, mean fraction of each completion before the first difference).
    Random bf16 models have near-tied top logits, so kernel-order rounding (other attention width or
    batch shape) flips some greedy tokens; the fp32 rows show the paths agree when rounding is small."""
    def prefix(x, y):
        return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) / max(len(x), 1)
    return sum(x == y for x, y in zip(a, b)) / len(a), sum(map(prefix, a, b)) / len(a)


def run(args) -> list[dict]:
    if not torch.cuda.is_available():
        print("gpu suite skipped: CUDA not available")
        return []
    quick = getattr(args, "quick", False)
    batches, max_tokens, reps = ((1, 8), 32, 1) if quick else ((1, 8, 32), 128, 3)
    model = build_model()
    print(f"gpu suite on {torch.cuda.get_device_name()} (torch {torch.__version__}); "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params bf16; "
          f"kv_blocks_for_memory(block {BLOCK}, utilization 0.5) = {kv_blocks_for_memory(model, BLOCK, 0.5)}")
    g = torch.Generator().manual_seed(0)
    V = QWEN2_05B["vocab_size"]
    rows = []
    for B in batches:
        prompts = [torch.randint(0, V, (32,), generator=g).tolist() for _ in range(B)]
        eager, eager_toks, _ = timed_generate(model, prompts, False, max_tokens, reps)
        graph, graph_toks, _ = timed_generate(model, prompts, True, max_tokens, reps)
        same, prefix = agreement(graph_toks, eager_toks)
        rows.append(dict(name=f"eager b={B}", batch=B, tokens_per_s=eager, speedup=1.0, lossy=False))
        rows.append(dict(name=f"graphs b={B}", batch=B, tokens_per_s=graph, speedup=graph / eager,
                         same_as_ref=same, prefix_as_ref=prefix, lossy=False))
        print(f"  b={B}: eager {eager:.0f} tok/s, graphs {graph:.0f} tok/s ({graph / eager:.2f}x)", flush=True)
    spec = {"method": "ngram", "num_draft_tokens": 5}
    rep = {B: [torch.randint(0, V, (16,), generator=g).tolist() * 4 for _ in range(B)] for B in batches[:2]}
    for B, prompts in rep.items():
        # repetitive prompts: a 16-token pattern 4 times, so the n-gram drafter has something to copy
        eager, _, _ = timed_generate(model, prompts, False, max_tokens, reps)
        ar, ar_toks, _ = timed_generate(model, prompts, True, max_tokens, reps)
        sp, sp_toks, summ = timed_generate(model, prompts, True, max_tokens, reps, spec)
        same, prefix = agreement(sp_toks, ar_toks)
        rows.append(dict(name=f"rep eager b={B}", batch=B, tokens_per_s=eager, speedup=1.0, lossy=False))
        rows.append(dict(name=f"rep graphs b={B}", batch=B, tokens_per_s=ar, speedup=ar / eager, lossy=False))
        rows.append(dict(name=f"rep graphs+ngram b={B}", batch=B, tokens_per_s=sp, speedup=sp / eager,
                         vs_graphs_ar=sp / ar, mean_accepted_len=summ["mean_accepted_len"],
                         same_as_ref=same, prefix_as_ref=prefix, lossy=False))
        print(f"  rep b={B}: eager {eager:.0f}, graphs AR {ar:.0f}, graphs+ngram {sp:.0f} tok/s "
              f"(accepted len {summ['mean_accepted_len']:.2f})", flush=True)
    # exactness check in fp32 (one timed run, 64 tokens): graphs vs eager, and spec vs AR, token for token
    model = build_model().float()
    B, prompts = batches[1], rep[batches[1]]
    eager, eager_toks, _ = timed_generate(model, prompts, False, 64, 1)
    graph, graph_toks, _ = timed_generate(model, prompts, True, 64, 1)
    sp, sp_toks, summ = timed_generate(model, prompts, True, 64, 1, spec)
    rows.append(dict(name=f"fp32 rep eager b={B}", batch=B, tokens_per_s=eager, speedup=1.0, lossy=False))
    same, prefix = agreement(graph_toks, eager_toks)
    rows.append(dict(name=f"fp32 rep graphs b={B}", batch=B, tokens_per_s=graph, speedup=graph / eager,
                     same_as_ref=same, prefix_as_ref=prefix, lossy=False))
    same, prefix = agreement(sp_toks, eager_toks)
    rows.append(dict(name=f"fp32 rep graphs+ngram b={B}", batch=B, tokens_per_s=sp, speedup=sp / eager,
                     vs_graphs_ar=sp / graph, mean_accepted_len=summ["mean_accepted_len"], same_as_ref=same,
                     prefix_as_ref=prefix, lossy=False))
    return rows
