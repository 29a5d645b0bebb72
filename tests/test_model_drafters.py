"""Model drafters (4-bit self-drafter, draft model): exact greedy, q = the sampled distribution, refresh."""
import random

import pytest
import torch

from conftest import make_hf_model
from nanospec import LLM, SamplingParams
from nanospec.drafters.base import DraftTarget
from nanospec.drafters.model_drafter import self_nf4_drafter
from nanospec.models.loader import load_model
from nanospec.engine.sampler import SamplingTensors, probs
from nanospec.tasks.tokenizer import build_tiny_vocab_tokenizer

WORDS = [f"w{i}" for i in range(57)]            # + 7 specials = vocab 64; eos = 2
TINY_KV = dict(block_size=4, num_kv_blocks=12)   # forces preemption with 6 prompts


def model_dir(path, words=WORDS, **kw):
    d, _ = make_hf_model(path, **kw)
    build_tiny_vocab_tokenizer(words).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    t = tmp_path_factory.mktemp
    return {"target": model_dir(t("target")),
            "draft": model_dir(t("draft"), hidden_size=32, layers=1, seed=7),
            "qwen2": model_dir(t("qwen2"), arch="qwen2", seed=3),
            "qwen3": model_dir(t("qwen3"), arch="qwen3", seed=4)}   # o_proj in_features 96: blocksize 32


def ragged_prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 64) for _ in range(rng.randrange(1, 11))] for _ in range(n)]


def self_spec(k=3):
    return {"method": "self_nf4", "num_draft_tokens": k}


@pytest.mark.parametrize("kv,n", [({}, 1), ({}, 6), (TINY_KV, 6)], ids=["kv-1", "kv-6", "tiny_kv-6"])
def test_greedy_token_identical_to_ar(dirs, kv, n):
    specs = [self_spec(), {"method": "draft_model", "model": dirs["draft"], "num_draft_tokens": 3},
             [{"method": "ngram", "num_draft_tokens": 3}, self_spec()]]
    sp = SamplingParams(temperature=0.0, max_tokens=18)
    prompts = ragged_prompts(n, n)
    ar = LLM(dirs["target"], **kv).generate(prompts, sp, use_tqdm=False)
    for spec in specs:
        llm = LLM(dirs["target"], controller=None, speculative=spec, **kv)
        out = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.token_ids for o in out] == [o.token_ids for o in ar], spec
        for o, a in zip(out, ar):
            assert o.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert llm.stats["proposed_tokens"] > 0
        if kv:
            assert llm.scheduler.num_preemptions > 0


def acceptance(d, spec, prompts):
    llm = LLM(d, controller=None, speculative=spec)
    ar = LLM(d).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    return llm.summary()["acceptance_rate"], llm


@pytest.mark.parametrize("arch", ["target", "qwen2", "qwen3"])
def test_self_drafter_acceptance_is_high(dirs, arch):
    """k=1: the acceptance rate is the per-token greedy agreement of drafter and target."""
    prompts = ragged_prompts(4, 3)
    rate, llm = acceptance(dirs[arch], self_spec(1), prompts)
    assert llm.drafter.checksum_matches(llm.model)
    assert rate > 0.5, rate                                 # a quantized copy mostly agrees
    if arch == "target":                                    # ... far more than an unrelated model
        other, _ = acceptance(dirs[arch], {"method": "draft_model", "model": dirs["draft"],
                                           "num_draft_tokens": 1}, prompts)
        assert rate > other + 0.3, (rate, other)


def spy(llm, log):
    d, orig = llm.drafter, llm.drafter.propose

    def propose(seqs, ks):
        ctx = [list(s.token_ids) for s in seqs]   # KV catch-up is 1 token, or 2 after all drafts were accepted
        assert all(len(s) - s.num_draft_computed in (1, 2) for s, k in zip(seqs, ks) if k)
        p = orig(seqs, ks)
        log.append((ctx, [s.params for s in seqs], p))
        return p
    d.propose = propose
    return d


@pytest.mark.parametrize("filters", [False, True], ids=["temperature", "top_k_top_p"])
@pytest.mark.parametrize("method", ["self", "draft_model"])
def test_q_is_exactly_the_sampled_distribution(dirs, method, filters):
    """q recorded per drafted position == probs of a fresh full forward of the drafter on prefix+drafts,
    through ragged drop-out, 2-token catch-up and preemption recompute; emitted logprobs == target's."""
    spec = self_spec(4) if method == "self" else {"method": "draft_model", "model": dirs["draft"],
                                                  "num_draft_tokens": 4}
    llm = LLM(dirs["target"], controller=None, speculative=spec, **TINY_KV)
    log = []
    d = spy(llm, log)
    f = [dict(top_k=5), dict(top_p=0.8)] if filters else [{}, {}]
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=1), SamplingParams(temperature=0.0, max_tokens=16),
              SamplingParams(temperature=0.7, max_tokens=16, **f[0]), SamplingParams(temperature=1.3, max_tokens=16, **f[1])]
    seqs = [s for i, p in enumerate(ragged_prompts(6, 4)) for s in llm.add_request(p, params[i % 4], i)]
    while llm.scheduler.has_work():
        llm.step()
    assert llm.scheduler.num_preemptions > 0 and llm.stats["proposed_tokens"] > 0
    checked = 0
    with torch.inference_mode():
        for ctx, ps, prop in log[::2]:
            for row, (c, p, drafts) in enumerate(zip(ctx, ps, prop.tokens)):
                if not drafts:
                    continue
                full = torch.tensor([c + drafts[:-1]])
                logits = d.model.logits(d.model(full))[:, len(c) - 1:]                  # [1, k, V]
                ref = probs(logits, SamplingTensors.from_params([p], 64, "cpu"))[0]
                q = prop.q[row, :len(drafts)]
                torch.testing.assert_close(q, ref, atol=1e-4, rtol=0)
                if p.temperature == 0:
                    assert drafts == logits[0].argmax(-1).tolist()
                else:
                    assert (q[torch.arange(len(drafts)), torch.tensor(drafts)] > 0).all()
                checked += 1
    assert checked >= 10
    target = load_model(dirs["target"])
    for s in seqs:
        o = llm.output(s)
        assert o.token_ids and all(0 <= t < 64 for t in o.token_ids)
        with torch.no_grad():
            logits = target.logits(target(torch.tensor([s.token_ids[:-1]])))[0, s.num_prompt_tokens - 1:]
        t = s.params.temperature or 1.0
        ref = torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-4, rtol=0)


def test_refresh_requantizes_in_place(dirs):
    llm = LLM(dirs["target"], controller=None, speculative=self_spec())
    d = llm.drafter
    lin = d.quantized["model.layers.1.mlp.down_proj"]
    ptrs = (lin.weight.data_ptr(), lin.weight.quant_state.absmax.data_ptr())
    assert d.checksum_matches(llm.model)
    policy = load_model(dirs["target"])                  # the trainer's copy: one real AdamW step
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    logits = policy.logits(policy(ids))
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    sd = {k: v.detach() for k, v in policy.state_dict().items()}
    x = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def drafter_logits(m):
        with torch.no_grad():
            return m.logits(m(x))
    with torch.no_grad():
        llm.model.load_state_dict(sd)                    # policy moved, drafter not told (no refresh)
    fresh = self_nf4_drafter(DraftTarget(llm.model, llm.vocab_size, llm.blocks.num_blocks, llm.blocks.block_size,
                                         llm.device))       # what the drafter should now be
    assert not d.checksum_matches(llm.model) and not d.checksum_matches(policy)
    assert (drafter_logits(d.model).argmax(-1) != drafter_logits(fresh.model).argmax(-1)).any()
    llm.load_weights(sd)                                 # in place + drafter.refresh(model)
    assert d.checksum_matches(llm.model) and d.checksum_matches(policy)
    assert torch.equal(drafter_logits(d.model), drafter_logits(fresh.model))
    assert (lin.weight.data_ptr(), lin.weight.quant_state.absmax.data_ptr()) == ptrs
    import bitsandbytes.functional as bF
    w = policy.model.layers[1].mlp.down_proj.weight.detach()
    err = (bF.dequantize_4bit(lin.weight.data, lin.weight.quant_state) - w).abs()
    assert err.max() <= 0.16 * w.abs().max() and err.mean() < 0.1 * w.abs().mean()
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ragged_prompts(3, 5)
    assert ([o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] ==
            [o.token_ids for o in LLM(policy, tokenizer=llm.tokenizer).generate(prompts, sp, use_tqdm=False)])


def test_bad_configs_fail_at_startup(dirs, tmp_path):
    small = model_dir(tmp_path / "v48", words=WORDS[:41], vocab_size=48)
    with pytest.raises(ValueError, match="vocab_size 48") as e:
        LLM(dirs["target"], controller=None, speculative={"method": "draft_model", "model": small})
    assert small in str(e.value) and dirs["target"] in str(e.value)
    other = model_dir(tmp_path / "tok", words=[f"x{i}" for i in range(57)], hidden_size=32, layers=1)
    with pytest.raises(ValueError, match="tokenizer of draft model"):
        LLM(dirs["target"], controller=None, speculative={"method": "draft_model", "model": other})
    with pytest.raises(ValueError, match=r"speculative\.model: expected a draft model directory"):
        LLM(dirs["target"], controller=None, speculative={"method": "draft_model"})
    with pytest.raises(ValueError, match="option of self_nf4.*'model'"):
        LLM(dirs["target"], controller=None, speculative={"method": "self", "model": small})


def test_self_drafter_any_hidden_size(tmp_path):
    """hidden 80 (no NF4 block size divides it): those layers stay full precision, named in a warning;
    the MLP's down_proj (in_features 160, a multiple of 32) is quantized; greedy is exact."""
    d = model_dir(tmp_path / "w80", hidden_size=80, heads=4, kv_heads=2, seed=9)
    with pytest.warns(UserWarning, match=r"6 of 8 layers stay in full precision.*qkv_proj \(in_features 80\)"):
        acc, llm = acceptance(d, self_spec(), ragged_prompts(4))
    names = set(llm.drafter.quantized)
    assert names and all(n.endswith("down_proj") for n in names)
    assert llm.drafter.checksum_matches(llm.model) and acc > 0.5
