"""Warm-start the draft head for `method: head` on the model's own generations for a task (`make head`).

    python distill_head.py --config configs/smollm2_arith.yaml --out runs/head_smollm2 --draft-vocab 4096
    python distill_head.py --config configs/default.yaml --out runs/head            # the embedded model (runs/sft)
    python distill_head.py ... --prompts 256 --epochs 4 --init runs/head_smollm2_warm   # more data, from a head

Self-distillation, EAGLE's recipe on our own data: the base model samples responses to the task's
training prompts at the run's temperature, one plain forward gives its hidden states, and the head
learns the model's next-token distribution from them (drafters/head.py: head_loss). The GRPO trainer
keeps training it online from there (`speculation.head_training`).
"""
import argparse
import json
import time
from pathlib import Path

import torch

from nanospec import LLM, SamplingParams
from nanospec.config import load_config, parse_with_overrides
from nanospec.drafters.head import DraftHead, completion_mask, frequent_tokens, head_loss, load_head
from nanospec.models.hub import resolve_model
from nanospec.tasks import format_prompt, task_from_config


def generations(llm, prompts, samples: int, max_tokens: int, temperature: float, seed: int = 0,
                cache: Path | None = None) -> list[tuple[list[int], int]]:
    """The model's own responses as (prompt + completion ids, prompt length); `cache` keeps them (a
    JSON file keyed by everything they depend on): sampling is most of a warm start's time on CPU."""
    key = dict(model=str(llm.model_path), prompts=prompts, samples=samples, max_tokens=max_tokens,
               temperature=temperature, seed=seed)
    if cache is not None and cache.is_file():
        stored = json.loads(cache.read_text())
        if stored["key"] == key:
            return [tuple(x) for x in stored["seqs"]]
    outs = llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=max_tokens, n=samples,
                                                seed=seed), use_tqdm=False)
    seqs = [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids)) for o in outs if len(o.token_ids) >= 3]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "seqs": seqs}))
    return seqs


def distill(llm, prompts, samples: int, max_tokens: int, temperature: float, epochs: int = 4,
            batch_tokens: int = 4096, lr: float = 1e-3, draft_vocab: int | None = None, seed: int = 0,
            cache: Path | None = None, log=print, init: DraftHead | None = None) -> DraftHead:
    t0 = time.perf_counter()
    seqs = generations(llm, prompts, samples, max_tokens, temperature, seed, cache)
    log(f"[head] {len(seqs)} samples, {sum(len(s) - p for s, p in seqs)} completion tokens in "
        f"{time.perf_counter() - t0:.0f}s")
    vocab = None
    if draft_vocab is not None and init is None:
        eos = llm.eos_ids
        vocab = frequent_tokens([s[p:] for s, p in seqs], draft_vocab, always=sorted(eos))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = (init if init is not None else DraftHead(llm.model, vocab)).float().train()
    # batches of similar lengths, hidden states once (the model is frozen here)
    seqs.sort(key=lambda x: len(x[0]))
    batches, cur = [], []
    for s in seqs:
        if cur and (len(cur) + 1) * len(s[0]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(s)
    batches.append(cur)
    data = []
    with torch.no_grad():      # (not inference_mode: the hidden states are inputs of the head's backward)
        for b in batches:
            L = max(len(s) for s, _ in b)
            ids = torch.tensor([s + [0] * (L - len(s)) for s, _ in b])
            data.append((ids, llm.model(ids), completion_mask([p for _, p in b], [len(s) for s, _ in b], L)))
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    total = epochs * len(data)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20) * (1 - i / total))
    g = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        seen, loss_sum = 0, 0.0
        for i in torch.randperm(len(data), generator=g).tolist():
            ids, hidden, mask = data[i]
            loss, n = head_loss(head, hidden, ids, mask)
            opt.zero_grad(set_to_none=True)
            (loss / max(n, 1)).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            seen, loss_sum = seen + n, loss_sum + float(loss.detach())
        log(f"[head] epoch {epoch + 1}/{epochs}: loss {loss_sum / max(seen, 1):.3f} per position "
            f"({time.perf_counter() - t0:.0f}s)")
    return head.eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default.yaml", help="the run's config: its task and model")
    ap.add_argument("--model", default=None, help="the model (default: model.path, else sft.out_dir)")
    ap.add_argument("--out", default="runs/head")
    ap.add_argument("--prompts", type=int, default=256, help="training prompts of the task")
    ap.add_argument("--samples", type=int, default=4, help="responses per prompt")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=None, help="the N most frequent response tokens (EAGLE-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None, help="continue from this head (its draft vocabulary) instead of a fresh one")
    args, overrides = parse_with_overrides(ap, argv)     # + --section.key=value on the config, as train.py
    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    model = args.model or (resolve_model(cfg.model.path) if cfg.model.path else cfg.sft.out_dir)
    llm = LLM(model, max_num_seqs=64, speculative=None)
    task = task_from_config(cfg.task)
    prompts = [format_prompt(llm.tokenizer, p.messages or p.prompt) for p in task.train(cfg.task.num_train)[:args.prompts]]
    g = cfg.grpo
    try:
        init = load_head(args.init, llm.model, "--init") if args.init else None
    except (ValueError, FileNotFoundError) as e:     # a head of another model, or no head directory
        ap.error(str(e))
    head = distill(llm, prompts, args.samples, g.max_completion_length, g.temperature, args.epochs,
                   draft_vocab=args.draft_vocab, seed=args.seed, cache=Path(args.out) / "generations.json", init=init)
    head.save(args.out)
    print(f"[head] wrote {args.out}")


if __name__ == "__main__":
    main()
