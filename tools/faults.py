"""Fault injection for the crash tests and the soak (`python -m tools.soak`), with no hook in nanospec:

    NANOSPEC_FAULT=point:step:rank:n torchrun ... -m tools.faults train.py --config ...

runs train.py with a few of nanospec's functions wrapped, and SIGKILLs this process the n-th time rank
`rank` passes `point` in GRPO step `step`: a death with no chance to clean up, as from the OOM killer
or a lost node. The points:
    rollout     after the n-th engine step of the rank's rollout (LLM.step inside RolloutWorker.run)
    optimizer   between the gradient all-reduce and the parameter update (grpo.clip_grad_norm_)
    save        while a checkpoint is written (rl/checkpoint.py's phases): n=1 after this rank's part,
                n=2 after the weights and optimizer, n=3 after the manifest, before the rename
                (n=2 and n=3 on rank 0 only, which writes them)
"""
import os
import runpy
import signal
import sys
import threading


def install(spec: str) -> None:
    point, step, rank, n = spec.split(":")
    step, n = int(step), int(n)
    if int(os.environ.get("RANK", 0)) != int(rank):
        return
    from nanospec.engine.llm import LLM
    from nanospec.rl import checkpoint, grpo, rollout
    passes, here = [0], threading.local()     # `here.step`: the GRPO step this thread is in

    def passed(at_step: int) -> None:
        if at_step == step:
            passes[0] += 1
            if passes[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name, before=None, after=None):
        fn = getattr(owner, name)

        def wrapped(*args, **kw):
            if before:
                before(*args)
            try:
                return fn(*args, **kw)
            finally:
                if after:
                    after(*args)
        setattr(owner, name, wrapped)

    if point == "rollout":                    # RolloutWorker.run(self, step, ...)
        wrap(rollout.RolloutWorker, "run", before=lambda worker, at, *a: setattr(here, "step", at),
             after=lambda *a: setattr(here, "step", None))
        wrap(LLM, "step", after=lambda *a: passed(getattr(here, "step", None)))
    elif point == "optimizer":
        wrap(grpo.Trainer, "_optimizer_step", before=lambda tr: setattr(here, "step", tr.step))
        wrap(grpo, "clip_grad_norm_", before=lambda *a: passed(here.step))
    elif point == "save":
        ckpt_step = lambda tmp, *a: int(tmp.name.rsplit("_", 1)[1])     # .tmp_step_NNNNNN
        for phase in ("write_rank_part", "write_shared_part", "write_manifest"):
            wrap(checkpoint, phase, after=lambda tmp, *a: passed(ckpt_step(tmp)))
    else:
        raise SystemExit(f"NANOSPEC_FAULT: unknown point {point!r} (rollout, optimizer, save)")


if __name__ == "__main__":
    if os.environ.get("NANOSPEC_FAULT"):
        install(os.environ["NANOSPEC_FAULT"])
    sys.argv = sys.argv[1:]                   # train.py and its arguments
    runpy.run_path(sys.argv[0], run_name="__main__")
