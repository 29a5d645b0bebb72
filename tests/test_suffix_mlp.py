"""The suffix-tree + n-gram-MLP drafter: per-position choice between a point-mass tree draft and a
draft sampled from the MLP, exact either way; distillation; config and save/load errors."""
import numpy as np
import pytest
import torch

from distill_mlp import distill
from nanospec.drafters.suffix_mlp import NGramMLP, SuffixMLPDrafter
from nanospec.engine.llm import LLM
from nanospec.models.loader import load_model
from nanospec.engine.sequence import SamplingParams
from test_exactness import (FILTERED, K, TEMP1, V, check_exact, exact, replay_controller,  # noqa: F401
                            repetitive_prompts, sample_with, v8)


def peaked_mlp(vocab_size, seed=0, scale=4.0):
    """An untrained MLP whose q is often confident (max q >= 0.8), so both branches get exercised."""
    torch.manual_seed(seed)
    mlp = NGramMLP(vocab_size, n=2, dim=8, hidden=16)
    with torch.no_grad():
        mlp.out.weight.mul_(scale * 10)
    return mlp.eval()


def counting(drafter):
    """Wrap propose: how many draft positions came from the tree (one-hot q) and from the MLP."""
    counts, orig = {"tree": 0, "mlp": 0}, drafter.propose

    def propose(seqs, budgets):
        p = orig(seqs, budgets)
        for row, toks in zip(p.q, p.tokens):
            for j in range(len(toks)):
                counts["tree" if row[j].max() == 1.0 and row[j].sum() == 1.0 else "mlp"] += 1
        return p
    drafter.propose = propose
    return counts


@pytest.mark.parametrize("params", ["temp1", "filtered"])
def test_suffix_mlp_sampling_is_exact(v8, exact, params):
    """Chi-square against the enumerated AR distribution, with tree and MLP positions mixed in rows."""
    sp = TEMP1 if params == "temp1" else FILTERED
    drafter = SuffixMLPDrafter(peaked_mlp(V), override=0.8, min_mlp_prob=0.3, min_path_prob=0.0)
    counts = counting(drafter)
    llm, outs = sample_with(v8, {"method": "suffix", "num_draft_tokens": K}, sp, drafter=drafter)
    assert counts["tree"] > 500 and counts["mlp"] > 500, counts
    check_exact(llm, outs, exact[params], f"suffix_mlp/{params}")


def test_suffix_mlp_sampling_is_exact_under_the_policies(v8, exact):
    """Its per-token confidence (tree frequency or MLP max q, never a function of the sampled token)
    feeds the controller's per-token pricing: draft lengths then depend on the drafts'
    confidence and past acceptance, and the samples must still be exact."""
    drafter = SuffixMLPDrafter(peaked_mlp(V), override=0.8, min_mlp_prob=0.3, min_path_prob=0.0)
    counts = counting(drafter)
    llm, outs = sample_with(v8, {"method": "suffix", "num_draft_tokens": K}, TEMP1, drafter=drafter,
                            setup=replay_controller)
    assert "suffix_mlp" in llm.controller.acceptance.counts and counts["mlp"] > 500
    check_exact(llm, outs, exact["temp1"], "suffix_mlp/policies")


def test_suffix_mlp_greedy_is_token_identical_and_logprobs_match(tiny_models):
    model = load_model(tiny_models["llama"][0])
    prompts = repetitive_prompts(8, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ar = LLM(model, block_size=4, max_model_len=64).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, block_size=4, max_model_len=64, num_kv_blocks=40,
              controller=None, speculative={"method": "suffix", "num_draft_tokens": K})       # K: the engine's draft bound
    llm.drafter = SuffixMLPDrafter(peaked_mlp(llm.vocab_size, scale=1.0), min_path_prob=0.0)
    for _ in range(2):      # the second round drafts from the first round's responses
        outs = llm.generate(prompts, params, use_tqdm=False, prompt_keys=list(range(8)))
        assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
        for o, r in zip(outs, ar):
            np.testing.assert_allclose(o.logprobs, r.logprobs, atol=1e-4)
    assert llm.stats["accepted_tokens"] > 0 and llm.scheduler.num_preemptions > 0


def test_distill_imitates_the_target_and_round_trips(tiny_models, tmp_path):
    """The distilled MLP is closer to the target's next-token distribution than an untrained one (a
    random target's next token depends on more than 3 tokens, so only part of the gap can close);
    save / load keep it; the engine loads it from a config dict and checks the vocabulary."""
    path = tiny_models["llama"][0]
    llm = LLM(path, max_num_seqs=16)
    prompts = repetitive_prompts(8, seed=6)
    mlp = distill(llm, prompts, samples_per_prompt=4, max_tokens=16, steps=300, n=3, log=lambda *a: None)
    ids = prompts[0] + llm.generate([prompts[0]], SamplingParams(temperature=1.0, max_tokens=16, seed=1),
                                    use_tqdm=False)[0].token_ids
    with torch.inference_mode():
        p = llm.model.logits(llm.model(torch.tensor([ids])))[0].softmax(-1)                 # [T, V]
        win = torch.tensor([mlp.window(ids[:i + 1]) for i in range(len(ids))])
        kl = lambda m: (p * (p.clamp_min(1e-12).log() - m(win).log_softmax(-1))).sum(-1).mean().item()
        assert kl(mlp) < 0.95 * kl(NGramMLP(llm.vocab_size, n=3).eval())
    mlp.save(tmp_path / "mlp")
    mlp.save(tmp_path / "mlp")                                   # overwrite in place
    with pytest.raises(ValueError, match="holds no"):
        mlp.save(tmp_path)                                       # never replaces another directory
    loaded = NGramMLP.load(tmp_path / "mlp")
    with torch.inference_mode():
        torch.testing.assert_close(loaded(win), mlp(win))
    spec = {"method": "suffix_mlp", "model": str(tmp_path / "mlp"), "num_draft_tokens": 4}
    engine = LLM(path, controller=None, speculative=spec)
    assert isinstance(engine.drafter, SuffixMLPDrafter) and engine.drafter.stochastic
    NGramMLP(llm.vocab_size + 1, n=3).save(tmp_path / "other")
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(path, controller=None, speculative={**spec, "model": str(tmp_path / "other")})
    with pytest.raises(ValueError, match="holds no n-gram MLP"):
        LLM(path, controller=None, speculative={**spec, "model": str(tmp_path)})
    with pytest.raises(ValueError, match="override"):
        LLM(path, controller=None, speculative={**spec, "override": 2.0})
    with pytest.raises(ValueError, match="expected an option of suffix_mlp"):
        LLM(path, controller=None, speculative={**spec, "depth": 8})


def test_untrained_mlp_learns_online_from_observed_rollouts(tiny_models):
    """Without a distilled model the MLP starts untrained (never confident: the drafter is the suffix
    tree) and next_step() trains it on the rollouts observed since the last step."""
    llm = LLM(tiny_models["llama"][0], max_num_seqs=32, controller=None, speculative={"method": "suffix_mlp", "num_draft_tokens": 4})
    drafter = llm.drafter
    prompts = repetitive_prompts(8, seed=7)
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=0), use_tqdm=False)
    assert len(drafter.finished) == len(outs) and not drafter.examples    # cut into examples at next_step
    before_mlp = {k: v.clone() for k, v in drafter.mlp.state_dict().items()}
    drafter.next_step()
    assert len(drafter.examples) == sum(len(o.token_ids) for o in outs) and not drafter.finished
    X = torch.tensor([w for w, _ in drafter.examples])
    Y = torch.tensor([t for _, t in drafter.examples])
    loss = lambda: torch.nn.functional.cross_entropy(drafter.mlp(X), Y).item()
    drafter.mlp.load_state_dict(before_mlp)
    before = loss()
    for _ in range(10):          # the same rollouts count as new once; later steps replay the buffer
        drafter.new_examples = len(drafter.examples)
        drafter.next_step()
    assert loss() < 0.8 * before and drafter.new_examples == 0
    assert not drafter.mlp.training
    # a GRPO checkpoint keeps what it learned (checkpoint.engine_state: trie, examples, MLP, optimizer)
    from nanospec.rl.checkpoint import engine_state, load_engine_state
    resumed = LLM(tiny_models["llama"][0], max_num_seqs=32, controller=None, speculative={"method": "suffix_mlp", "num_draft_tokens": 4})
    load_engine_state(resumed, engine_state(llm))
    other = resumed.drafter
    with torch.inference_mode():
        torch.testing.assert_close(other.mlp(X), drafter.mlp(X))
    assert list(other.examples) == list(drafter.examples)
    assert other.opt.param_groups[0]["params"][0] is next(other.mlp.parameters())   # optimizer on the loaded MLP
