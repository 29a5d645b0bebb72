"""Tools that read runs or project them; they import nanospec, nanospec never imports them.

    python -m tools.report RUN_DIR [--compare AR_DIR]   # PNGs + report.md of a run (or of seeds per arm)
    python -m tools.simulate --run RUN_DIR              # replay a run's traces on a latency model; project
    python -m tools.soak --minutes N                    # GRPO under random kills and request floods
    NANOSPEC_FAULT=rollout:3:0:2 torchrun ... -m tools.faults train.py ...   # one kill (tools/faults.py)
"""
