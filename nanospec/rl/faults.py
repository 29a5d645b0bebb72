"""Fault injection for the crash tests and the soak script (`python -m nanospec.soak`).

    NANOSPEC_FAULT="point:step:rank:n"

SIGKILLs this process the n-th time rank `rank` passes `fault_point(point, step, rank)` in GRPO step
`step`: a death with no chance to clean up, as from the OOM killer or a lost node. The points:
    rollout     every engine step of a rank's rollout (RolloutWorker.run)
    optimizer   between the gradient all-reduce and the parameter update (Trainer._optimizer_step)
    save        while a checkpoint is written: n=1 after this rank's state, n=2 after the weights
                and the trainer state, n=3 after the manifest, before the rename (rank 0 only for 2, 3)
"""
import os
import signal

_passes: dict[tuple, int] = {}


def fault_point(point: str, step: int, rank: int) -> None:
    spec = os.environ.get("NANOSPEC_FAULT")
    if not spec or spec.split(":")[:3] != [point, str(step), str(rank)]:
        return
    key = (point, step)
    _passes[key] = _passes.get(key, 0) + 1
    if _passes[key] == int(spec.split(":")[3]):
        os.kill(os.getpid(), signal.SIGKILL)
