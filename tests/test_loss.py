"""nanospec.rl.loss: hand-computed advantages/losses, micro-batch additivity, TIS, mismatch, logprobs."""
import math

import pytest
import torch

from nanospec.config import GRPOConfig
from nanospec.rl.grpo import shape_rewards
from nanospec.engine.sampler import token_logprobs
from nanospec.rl.loss import group_advantages, logprob_mismatch, overlong_penalty, policy_loss, tis_weights

A = pytest.approx


def test_group_advantages_scaled_unscaled_zero_std():
    r = torch.tensor([1.0, 3.0, 5.0, 5.0])                 # groups of 2: [1,3] and [5,5]
    adv = group_advantages(r, 2)
    s = math.sqrt(((1 - 2) ** 2 + (3 - 2) ** 2) / (2 - 1))  # unbiased std = sqrt(2)
    assert adv.tolist() == A([-1 / (s + 1e-4), 1 / (s + 1e-4), 0.0, 0.0], abs=1e-6)   # equal group: 0
    adv = group_advantages(r, 2, scale_rewards=False)
    assert adv.tolist() == A([-1.0, 1.0, 0.0, 0.0])
    adv = group_advantages(torch.tensor([0.0, 0.0, 3.0]), 3)  # mean 1, var (1+1+4)/2 = 3
    assert adv.tolist() == A([-1 / (3 ** 0.5 + 1e-4), -1 / (3 ** 0.5 + 1e-4), 2 / (3 ** 0.5 + 1e-4)], abs=1e-6)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(r, 3)


def test_overlong_penalty_is_dapo_eq13():
    # cap 128, buffer 32: no penalty up to 96 tokens, then linear to -factor at the cap (DAPO eq. 13)
    lengths = torch.tensor([10, 96, 104, 120, 128])
    assert overlong_penalty(lengths, 128, 32).tolist() == A([0.0, 0.0, -0.25, -0.75, -1.0])
    assert overlong_penalty(lengths, 128, 32, factor=0.5).tolist() == A([0.0, 0.0, -0.125, -0.375, -0.5])
    # the trainer's shaping -> advantages: the truncated sample of a group drops below a wrong finished one
    g = GRPOConfig(max_completion_length=128, overlong_buffer=32)
    shaped = shape_rewards([1.0, 0.0, 0.0, 0.0], [50, 60, 128, 70], g)
    assert group_advantages(shaped, 4, scale_rewards=False).tolist() == A([1.0, 0.0, -1.0, 0.0])
    assert shape_rewards([1.0, 0.0], [50, 128], GRPOConfig(max_completion_length=128)).tolist() == [1.0, 0.0]


def _batch(ratios, old=None):
    r = torch.tensor(ratios)
    old = torch.full_like(r, -1.0) if old is None else old
    return (old + r.log()).requires_grad_(), old


def test_policy_loss_grpo_dapo_asymmetric_clip():
    # A=+1 row: rho 1.0 -> -1; rho 1.5 clipped to 1+0.28 -> -1.28 (high clip); rho 0.5 -> -0.5 (unclipped)
    # A=-2 row: rho 0.7 -> min(-1.4, 0.8*-2=-1.6) -> +1.6 (low clip); rho 1.1 -> +2.2; third token padded
    # A=-1 row: rho 1.5 -> min(-1.5, -1.28) -> +1.5 (no clip on this side); rho 1.0 -> +1; padded
    logp, old = _batch([[1.0, 1.5, 0.5], [0.7, 1.1, 2.0], [1.5, 1.0, 3.0]])
    mask, adv = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]]), torch.tensor([1.0, -2.0, -1.0])
    kw = dict(epsilon=0.2, epsilon_high=0.28)
    loss, st = policy_loss(logp, old, adv, mask, **kw)
    assert loss.item() == A(((-1 - 1.28 - 0.5) / 3 + (1.6 + 2.2) / 2 + (1.5 + 1) / 2) / 3, abs=1e-6)
    assert st["clip_frac"] == A(2 / 7) and st["clip_frac_low"] == A(1 / 7) and st["clip_frac_high"] == A(1 / 7)
    assert st["ratio_mean"] == A((1 + 1.5 + 0.5 + 0.7 + 1.1 + 1.5 + 1) / 7) and st["num_tokens"] == 7
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dapo", num_tokens_global=7, **kw)
    assert loss.item() == A((-1 - 1.28 - 0.5 + 1.6 + 2.2 + 1.5 + 1) / 7, abs=1e-6)
    loss.backward()  # clipped tokens get no gradient; unclipped: d(-rho*A)/dlogp = -rho*A / 7
    assert logp.grad.flatten().tolist() == A([-1 / 7, 0, -0.5 / 7, 0, 2.2 / 7, 0, 1.5 / 7, 1 / 7, 0], abs=1e-6)
    # symmetric epsilon: rho 1.5 with A>0 now clipped at 1.2
    loss, _ = policy_loss(logp, old, adv, mask, epsilon=0.2, loss_type="dapo", num_tokens_global=7)
    assert loss.item() == A((-1 - 1.2 - 0.5 + 1.6 + 2.2 + 1.5 + 1) / 7, abs=1e-6)
    # tis_weight multiplies the surrogate per token
    w = torch.tensor([[0.5, 1.0, 0.0], [2.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dapo", num_tokens_global=7, tis_weight=w, **kw)
    assert loss.item() == A((-0.5 - 1.28 + 3.2 + 2.2 + 1.5 + 0.5) / 7, abs=1e-6)


def test_policy_loss_kl_k3():
    logp, old = _batch([[1.0, 1.0], [1.0, 1.0]])
    ln2 = math.log(2)
    ref = (logp + torch.tensor([[ln2, -ln2], [0.0, 5.0]])).detach()  # d = ref - logp
    mask = torch.tensor([[1, 1], [1, 0]])
    k = [2 - ln2 - 1, 0.5 + ln2 - 1, 0.0]                             # e^d - d - 1
    loss, st = policy_loss(logp, old, torch.zeros(2), mask, beta=0.1, ref_logp=ref)
    assert loss.item() == A(0.1 * ((k[0] + k[1]) / 2 + k[2] / 1) / 2, abs=1e-7)
    assert st["kl"] == A(sum(k) / 3, abs=1e-7)
    with pytest.raises(ValueError, match="beta"):
        policy_loss(logp, old, torch.zeros(2), mask, beta=0.1)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_microbatch_sum_equals_full_batch(loss_type):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    logp0 = -torch.rand(B, T, generator=g) * 3
    old = logp0 + 0.3 * torch.randn(B, T, generator=g)
    ref = logp0 + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lens = torch.tensor([5, 1, 3, 0, 4, 2])
    mask = (torch.arange(T)[None] < lens[:, None]).long()
    w = torch.rand(B, T, generator=g) * 2
    kw = dict(epsilon=0.2, epsilon_high=0.3, beta=0.05, loss_type=loss_type, num_seqs_global=B,
              num_tokens_global=int(mask.sum()))

    def run(idx, scale=1.0):  # -> (loss, d(scale*loss)/dlogp embedded in a [B,T] tensor)
        logp = logp0.clone().requires_grad_()
        loss, _ = policy_loss(logp[idx], old[idx], adv[idx], mask[idx], ref_logp=ref[idx], tis_weight=w[idx], **kw)
        (scale * loss).backward()
        return loss.detach(), logp.grad

    full, gfull = run(slice(None))
    kw2 = dict(kw, num_seqs_global=None) if loss_type == "grpo" else kw
    default, _ = policy_loss(logp0, old, adv, mask, ref_logp=ref, tis_weight=w, **kw2)  # default denom = B
    assert default.item() == A(full.item(), abs=1e-6)
    # two "ranks" with two micro-batches each: micro-batch losses sum to the full loss; with DDP
    # (grads averaged over W ranks) each rank backprops W * loss, and the averaged grad is the full one
    W, ranks = 2, [[(0, 2), (2, 3)], [(3, 5), (5, 6)]]
    parts = [[run(slice(a, b), scale=W) for a, b in r] for r in ranks]
    assert sum(p[0] for r in parts for p in r).item() == A(full.item(), abs=1e-6)
    ddp_grad = sum(sum(p[1] for p in r) for r in parts) / W
    torch.testing.assert_close(ddp_grad, gfull)


def test_policy_loss_validation_and_padding_garbage():
    logp, old = _batch([[1.0, 1.0]])
    with pytest.raises(ValueError, match="num_tokens_global"):
        policy_loss(logp, old, torch.ones(1), torch.ones(1, 2), loss_type="dapo")
    with pytest.raises(ValueError, match="adv"):
        policy_loss(logp, old, torch.ones(2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(logp, old, torch.ones(1), torch.ones(1, 2), loss_type="ppo")
    # padded positions with huge log-ratio must not produce inf/nan in loss or gradient
    lp = torch.tensor([[-1.0, 500.0]], requires_grad=True)
    loss, _ = policy_loss(lp, torch.tensor([[-1.0, -500.0]]), torch.ones(1), torch.tensor([[1, 0]]))
    loss.backward()
    assert loss.item() == A(-1.0) and torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0


def test_tis_truncate_and_mask():
    rollout = torch.full((1, 5), -2.0)
    rho = [3.0, 0.6, 0.2, 1.0]
    train = rollout + torch.tensor([[math.log(x) for x in rho] + [50.0]])   # last token is padding
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    w, st = tis_weights(train, rollout, mask, cap=2.0)
    assert w.tolist()[0] == A([2.0, 0.6, 0.2, 1.0, 0.0], abs=1e-6)
    assert st["tis/mean_weight"] == A(3.8 / 4, abs=1e-6) and st["tis/frac_truncated"] == A(0.25)
    w, st = tis_weights(train, rollout, mask, cap=2.0, mode="mask")        # keep 0.5 <= rho <= 2
    assert w.tolist()[0] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert st["tis/frac_masked"] == A(0.5) and st["tis/mean_weight"] == A(0.5)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap"):
        tis_weights(train, rollout, mask, cap=0.5)


def test_logprob_mismatch():
    roll = -torch.rand(2, 3, generator=torch.Generator().manual_seed(1)) * 4
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    fv = torch.tensor([[True, False, True], [False, False, True]])
    same = logprob_mismatch(roll.clone(), roll, mask, fv)
    assert all(v == A(0.0, abs=1e-7) for v in same.values()) and len(same) == 5
    train = roll + torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 5.0]])       # 5.0 sits on padding
    m = logprob_mismatch(train, roll, mask, fv)
    assert m["mismatch/mean_abs"] == A((0.1 + 0.2 + 0.3) / 5, abs=1e-6)
    assert m["mismatch/max_abs"] == A(0.3, abs=1e-6)
    assert m["mismatch/seq_logratio_std"] == A(0.2, abs=1e-6)           # sums -0.1, 0.3 -> pop. std 0.2
    assert m["mismatch/verify_mean_abs"] == A((0.1 + 0.0) / 2, abs=1e-6)
    assert m["mismatch/decode_mean_abs"] == A((0.2 + 0.3 + 0.0) / 3, abs=1e-6)
    m = logprob_mismatch(train, roll, mask, torch.zeros(2, 3, dtype=torch.bool))
    assert math.isnan(m["mismatch/verify_mean_abs"])
    assert "mismatch/verify_mean_abs" not in logprob_mismatch(train, roll, mask)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0, 1.9])
def test_token_logprobs_matches_log_softmax(temperature):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 4, 11, generator=g) * 3).requires_grad_()
    tokens = torch.randint(0, 11, (2, 4), generator=g)
    t = temperature or 1.0
    ref = torch.log_softmax(logits / t, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    out = token_logprobs(logits, tokens, temperature)
    torch.testing.assert_close(out, ref)
    (gout,) = torch.autograd.grad(out.sum(), logits)
    (gref,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(gout, gref)
    bf = token_logprobs(logits.detach().bfloat16(), tokens, temperature)
    assert bf.dtype == torch.float32
    torch.testing.assert_close(bf, ref.detach(), atol=0.1, rtol=0)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, -1.0)
