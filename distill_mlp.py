"""Distill the n-gram MLP for `method: suffix_mlp` from a model on the embedded task (`make mlp`).

    python distill_mlp.py --model runs/sft --out runs/ngram_mlp
"""
import argparse
import time

import torch

from nanospec import LLM, SamplingParams
from nanospec.drafters.suffix_mlp import NGramMLP
from nanospec.tasks import SyntheticTask, format_prompt


def distill(llm, prompts, samples_per_prompt: int = 8, max_tokens: int = 112, steps: int = 3000,
            batch_size: int = 512, lr: float = 3e-3, n: int = 4, seed: int = 0, log=print) -> NGramMLP:
    """An NGramMLP that imitates `llm`'s model on its own T=1 samples of `prompts`."""
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=max_tokens, n=samples_per_prompt,
                                                seed=seed), use_tqdm=False)
    mlp = NGramMLP(llm.vocab_size, n=n)
    windows, targets = [], []
    with torch.inference_mode():
        for o in outs:
            ids = o.prompt_token_ids + o.token_ids
            hidden = llm.model(torch.tensor([ids], device=llm.device))[0, len(o.prompt_token_ids) - 1:-1]
            targets.append(llm.model.logits(hidden).softmax(-1).cpu())                 # [T, V]: p at each
            windows += [w for w, _ in mlp.examples(ids, len(o.prompt_token_ids))]
    X, P = torch.tensor(windows), torch.cat(targets)
    opt = torch.optim.AdamW(mlp.parameters(), lr=lr)
    for _ in range(steps):
        i = torch.randint(0, len(X), (batch_size,))
        loss = -(P[i] * mlp(X[i]).log_softmax(-1)).sum(-1).mean()      # H(p, q): distillation on soft labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    entropy = -(P * P.clamp_min(1e-12).log()).sum(-1).mean().item()
    log(f"[suffix_mlp] distilled on {len(X)} positions of {len(outs)} samples in {time.perf_counter() - t0:.0f}s: "
        f"H(p, q) {loss.item():.3f} (H(p) {entropy:.3f})")
    return mlp.eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="distill an n-gram MLP drafter from a model on the embedded task")
    ap.add_argument("--model", default="runs/sft")
    ap.add_argument("--out", default="runs/ngram_mlp")
    ap.add_argument("--prompts", type=int, default=128, help="train prompts, 8 samples each")
    ap.add_argument("--steps", type=int, default=3000, help="optimizer steps of 512 positions")
    args = ap.parse_args(argv)
    llm = LLM(args.model, max_num_seqs=64)
    prompts = [format_prompt(llm.tokenizer, p.prompt) for p in SyntheticTask(seed=0).train(args.prompts)]
    distill(llm, prompts, steps=args.steps).save(args.out)
    print(f"[suffix_mlp] wrote {args.out}")


if __name__ == "__main__":
    main()
