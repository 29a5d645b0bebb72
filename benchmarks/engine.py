"""nanospec AR decoding vs `transformers.generate` on the same tiny model, prompts and max_tokens.

Both greedy with EOS ignored, so both produce exactly batch * max_tokens tokens. The two run one call
each in turn, `repeats` pairs, the order reversed every other pair; `speedup` is the median of the
pairs' ratios, min-max beside it: on this VM the medians of the two series taken apart moved 10-40%
between runs (docs/results.md), a slow stretch of the box lands on both calls of a pair alike.
"""
import statistics
import tempfile
import time

import torch

from nanospec import LLM, SamplingParams


def tiny_llama(path: str, vocab: int = 512, hidden: int = 256, layers: int = 4, seed: int = 0):
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def run(args) -> list[dict]:
    max_tokens = 32 if args.quick else 128
    repeats = 3 if args.quick else 9
    rows = []
    with tempfile.TemporaryDirectory() as d:
        hf = tiny_llama(d)
        params = sum(p.numel() for p in hf.parameters())
        llm = LLM(d, max_num_seqs=32, block_size=16)
        for batch in (1, 16):
            g = torch.Generator().manual_seed(batch)
            prompts = [torch.randint(0, 512, (int(l),), generator=g).tolist()
                       for l in torch.randint(8, 24, (batch,), generator=g)]
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

            def ours():
                outs = llm.generate(prompts, sp, use_tqdm=False)
                assert all(len(o.token_ids) == max_tokens for o in outs)

            # transformers needs a padded batch: left padding with an attention mask
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

            def theirs():
                with torch.inference_mode():
                    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
                assert out.shape[1] == width + max_tokens

            times, pairs = {"nanospec": [], "transformers": []}, (("nanospec", ours), ("transformers", theirs))
            ours(), theirs()                                   # warm-up
            for r in range(repeats):
                for name, fn in pairs if r % 2 else pairs[::-1]:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            ratios = [a / b for a, b in zip(times["transformers"], times["nanospec"])]
            for name in ("transformers", "nanospec"):
                mine = [1.0] if name == "transformers" else ratios
                sec = statistics.median(times[name])
                rows.append(dict(name=f"{name} b{batch}", batch=batch, params=params, max_tokens=max_tokens,
                                 seconds=sec, tokens_per_s=batch * max_tokens / sec, speedup=statistics.median(mine),
                                 min=min(mine), max=max(mine), lossy=False))
    return rows
