"""Live curves: each step's metrics as TensorBoard scalars (`run.log_to: [jsonl, tensorboard]`).

metrics.jsonl stays the run's record (resume, report.py, simulate.py read it); TensorBoard is a view
of the same numbers while the run goes: every finite number of the step's metrics line, under its
metrics.jsonl name (`reward_mean`, `reward/<function>`, `eval/accuracy`, ...) at x = step. Lists
(`rank_*`, per-response traces) stay in the jsonl. The writer is torch.utils.tensorboard's; the
`tensorboard` package it needs is optional (config.py checks it is there when asked for).
"""
from __future__ import annotations

import math
from pathlib import Path


def tensorboard_writer(run_dir, log_to):
    """A SummaryWriter on RUN_DIR/tensorboard when `log_to` names tensorboard, else None."""
    if "tensorboard" not in log_to:
        return None
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))


def log_scalars(writer, metrics: dict) -> None:
    """One step's numbers, flushed at once (the curve moves while the run goes)."""
    if writer is None:
        return
    for key, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and key != "step":
            writer.add_scalar(key, v, metrics["step"])
    writer.flush()
