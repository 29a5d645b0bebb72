"""Distill the n-gram MLP for `method: suffix_mlp` from a model on the embedded task (`make mlp`).

    python distill_mlp.py --model runs/sft --out runs/ngram_mlp
"""
import argparse

from nanospec import LLM
from nanospec.drafters.suffix_mlp import distill
from nanospec.tasks import SyntheticTask, format_prompt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="distill an n-gram MLP drafter from a model on the embedded task")
    ap.add_argument("--model", default="runs/sft")
    ap.add_argument("--out", default="runs/ngram_mlp")
    ap.add_argument("--prompts", type=int, default=128, help="train prompts, 8 samples each")
    args = ap.parse_args(argv)
    llm = LLM(args.model, max_num_seqs=64)
    prompts = [format_prompt(llm.tokenizer, p.prompt) for p in SyntheticTask(seed=0).train(args.prompts)]
    distill(llm, prompts).save(args.out)
    print(f"[suffix_mlp] wrote {args.out}")


if __name__ == "__main__":
    main()
