"""GRPO on top of the engine: rollouts across ranks (rollout.py, scheduling.py, dist.py), the loss
(loss.py), the trainer (grpo.py), SFT warm-up (sft.py), checkpoints (checkpoint.py), reports (report.py).
May import everything else in nanospec; nothing imports it.
"""
