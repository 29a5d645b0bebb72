"""SFT warm-up for the embedded default: a tiny decoder learns the synthetic task from imperfect traces.

Why: no weights can be downloaded, and GRPO on a random model gets reward 0 everywhere (no signal).
A few minutes of supervised training on traces with injected slips (`sft.error_rate`) gives a model
that is confident on most tokens (as a real policy is) but slips now and then, more on long prompts,
so rewards vary within a group and GRPO has something to improve. Loss = mean cross-entropy over
completion tokens only (prompt tokens are context, not targets). Batches are buckets of similar
length (few padded tokens, many more steps/s than random batches); bf16 autocast is optional and by
default on only where the CPU has native bf16 (`native_bf16`: AVX512-BF16 or AMX): where bf16 is
emulated (AVX2-only CPUs) it is many times *slower* than fp32.

The result is an HF directory (`loader.save_model`: loadable by transformers) in `sft.out_dir`,
reused by later runs when its `sft_fingerprint.json` matches this config; a mismatching directory
written by this module is retrained, anything else there is an error (never silently reused).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from nanospec.rl import dist
from nanospec.models.loader import save_model
from nanospec.models.decoder import CausalLM, ModelArgs
from nanospec.tasks import build_tokenizer, format_prompt, task_from_config

FINGERPRINT = "sft_fingerprint.json"


def model_args(mc, tokenizer) -> ModelArgs:
    """The tiny model of the `model` config section, sized to the tokenizer's vocabulary."""
    eos = tokenizer.eos_token_id
    return ModelArgs(arch=mc.arch, vocab_size=len(tokenizer), hidden_size=mc.hidden_size,
                     intermediate_size=mc.intermediate_size, num_layers=mc.num_layers, num_heads=mc.num_heads,
                     num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim or mc.hidden_size // mc.num_heads,
                     rope_theta=mc.rope_theta, max_position_embeddings=mc.max_position_embeddings,
                     tie_word_embeddings=mc.tie_word_embeddings, attention_bias=mc.arch == "qwen2",
                     qk_norm=mc.arch == "qwen3", bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                     pad_token_id=tokenizer.pad_token_id)


@torch.no_grad()
def init_weights(model: CausalLM, std: float = 0.02) -> CausalLM:
    """GPT-2 init: N(0, std) matrices, residual output projections scaled by 1/sqrt(2L), zero biases.
    (PyTorch's defaults give N(0, 1) embeddings: with tied weights the first logits have std ~sqrt(D).)"""
    resid = std / math.sqrt(2 * model.args.num_layers)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.normal_(0.0, resid if name.endswith(("o_proj.weight", "down_proj.weight")) else std)
        elif name.endswith("bias"):
            p.zero_()
    return model


def native_bf16() -> bool:
    """Does this CPU do bf16 matmuls natively (AVX512-BF16 or AMX)? Private torch probes, so guarded."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def fingerprint(cfg, tokenizer) -> dict:
    """Everything the SFT result depends on (a change means retrain)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    sft = {k: v for k, v in asdict(cfg.sft).items() if k != "out_dir"}
    task = {k: v for k, v in asdict(cfg.task).items() if k not in ("num_train", "num_test")}
    return {"version": 1, "model": {k: v for k, v in asdict(cfg.model).items() if k != "path"},
            "task": task, "sft": sft, "seed": cfg.run.seed,
            "vocab_sha256": hashlib.sha256(vocab.encode()).hexdigest()}


def encode_example(task, tokenizer, problem, rng, error_rate) -> tuple[list[int], int]:
    """-> (prompt + completion + eos ids, prompt length)."""
    prompt = format_prompt(tokenizer, problem.prompt)
    completion = tokenizer.encode(task.sft_text(problem, rng, error_rate), add_special_tokens=False)
    return prompt + completion + [tokenizer.eos_token_id], len(prompt)


def length_buckets(examples: list[tuple[list[int], int]], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped into batches of similar length, batch order shuffled."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), rng.random()))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(examples, idx: list[int], pad_id: int, max_len: int):
    """-> input_ids [B, T], loss mask [B, T-1] over targets ids[:, 1:] (1 = completion token)."""
    rows = [examples[i] for i in idx]
    T = min(max(len(r[0]) for r in rows), max_len)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T - 1)
    for b, (r, p) in enumerate(rows):
        r = r[:T]
        ids[b, :len(r)] = torch.tensor(r)
        mask[b, p - 1:len(r) - 1] = 1.0     # target r[t+1] is a completion token iff t+1 >= p
    return ids, mask


def train_sft(cfg, tokenizer, log=print) -> CausalLM:
    """SFT from scratch on `cfg.sft.steps` length-bucketed batches; returns the fp32 model.
    Collective when a process group exists: rank r takes rows r, r+W, ... of every batch, the loss is
    normalised by the whole batch's token count and gradients are summed, so every rank ends with the
    same weights as one process would (data parallel beats intra-op threads on small matmuls)."""
    sc, seed, rank, world = cfg.sft, cfg.run.seed, dist.rank(), dist.world_size()
    torch.manual_seed(seed)
    model = init_weights(CausalLM(model_args(cfg.model, tokenizer)))
    if sc.steps == 0:
        return model
    task = task_from_config(cfg.task)
    rng = random.Random(f"nanospec-sft/{seed}")
    problems = task.sample("train", sc.steps * sc.batch_size, seed=dist.hash_seed(seed, "sft"))
    t0 = time.perf_counter()
    examples = [encode_example(task, tokenizer, p, rng, sc.error_rate) for p in problems]
    batches = length_buckets(examples, sc.batch_size, rng)
    bf16 = native_bf16() if sc.bf16_autocast is None else sc.bf16_autocast
    log(f"[sft] {len(examples)} traces tokenized in {time.perf_counter() - t0:.1f}s; {world} rank(s), "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, {sc.steps} steps, "
        f"bf16 autocast {'on' if bf16 else 'off'}")
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=sc.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, sc.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(   # linear warmup, then cosine decay to 10%
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * s / sc.steps)))
    model.train()
    t0, run, max_len = time.perf_counter(), None, cfg.model.max_position_embeddings
    for step, idx in enumerate(batches[:sc.steps]):
        n_tok = sum(min(len(examples[i][0]), max_len) - examples[i][1] for i in idx)  # targets, whole batch
        opt.zero_grad(set_to_none=False)
        loss = torch.zeros(())
        if idx[rank::world]:
            ids, mask = collate(examples, idx[rank::world], tokenizer.pad_token_id, max_len)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model.logits(model(ids[:, :-1]))                           # [B, T-1, V] fp32
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask).sum() / n_tok
            loss.backward()
        dist.all_reduce_grads(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        run = loss.item() * world if run is None else 0.95 * run + 0.05 * loss.item() * world
        if (step + 1) % max(1, sc.steps // 10) == 0 or step + 1 == sc.steps:
            log(f"[sft] step {step + 1}/{sc.steps} loss ~{run:.4f} ({time.perf_counter() - t0:.0f}s)")
    return model.eval()


def sft_is_current(out_dir: Path, fp: dict) -> bool:
    f = out_dir / FINGERPRINT
    if not out_dir.exists():
        return False
    if not f.is_file():
        raise ValueError(f"sft.out_dir: {out_dir} exists but holds no {FINGERPRINT} (not written by nanospec "
                         f"SFT, or an interrupted write); delete it or choose another sft.out_dir")
    try:
        return json.loads(f.read_text()) == fp
    except json.JSONDecodeError:
        return False


def prepare_sft_model(cfg, log=print) -> Path:
    """The SFT model directory for `cfg` (collective): reused if current, else trained by all ranks
    (data parallel) and written by one rank per node (local rank 0) to a temp dir renamed into place;
    then everyone loads it. Nodes on one filesystem: the first rename wins, the others' copies (the
    same weights: the ranks trained together) are dropped."""
    out, tokenizer = Path(cfg.sft.out_dir), build_tokenizer()
    fp = fingerprint(cfg, tokenizer)
    status = None
    if dist.local_rank() == 0:
        try:
            status = sft_is_current(out, fp)
        except ValueError as e:   # every rank must raise, not wait for rank 0 forever
            status = e
    found = [s for s in dist.all_gather_object(status) if s is not None]
    status = next((s for s in found if isinstance(s, Exception)), all(found))
    if isinstance(status, Exception):
        raise status
    if status:
        log(f"[sft] reusing {out} (fingerprint matches)")
    else:
        if out.exists():
            log(f"[sft] {out} was trained with another config: retraining")
        model = train_sft(cfg, tokenizer, log)
        if dist.local_rank() == 0:
            tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            save_model(model, tmp, tokenizer)
            (tmp / FINGERPRINT).write_text(json.dumps(fp, indent=1))
            shutil.rmtree(out, ignore_errors=True)
            try:
                tmp.rename(out)
            except OSError:       # another node's writer renamed its copy into place first
                shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return out
