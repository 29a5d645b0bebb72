"""Small torch.distributed helpers: one process per rank (torchrun, or mp.spawn in tests).

Everything degrades to a single process when no process group is initialised (world size 1), so
the trainer and the rollout worker have one code path. gloo on CPU, nccl on GPU.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Init the default group from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) if
    WORLD_SIZE > 1; returns (rank, world_size). nccl also pins this process to GPU LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not is_dist():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return rank(), world_size()


def set_threads_per_rank() -> int:
    """Split the cores between the ranks on this host, so ranks do not steal each other's cores."""
    n = max(1, (os.cpu_count() or 1) // max(1, local_world_size()))
    torch.set_num_threads(n)
    return n


def all_gather_object(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] (picklable objects); [obj] without a process group."""
    if not is_dist():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if is_dist():
        dist.barrier()


def cleanup() -> None:
    if is_dist():
        dist.destroy_process_group()


class DoneSignal:
    """Non-blocking 'every rank has arrived' flag: a rank that finishes early keeps working (bubble
    drafting) and polls `done()` between engine steps instead of blocking in a barrier.

    `arrive()` issues an async all-reduce; it can only complete once every rank has issued it, so
    `work.is_completed()` (supported by gloo and nccl) turns True right after the last rank arrives.
    No other collective may be issued between `arrive()` and `wait()` (collectives are ordered).
    """

    def __init__(self):
        self.work = self._flag = None
        self.arrived = False

    def arrive(self) -> None:
        if self.arrived:
            raise RuntimeError("DoneSignal.arrive() called twice")
        self.arrived = True
        if is_dist():
            dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            self._flag = torch.ones(1, device=dev)       # kept alive until the collective completes
            self.work = dist.all_reduce(self._flag, async_op=True)

    def done(self) -> bool:
        if not self.arrived:
            raise RuntimeError("DoneSignal.done() before arrive()")
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if not self.arrived:
            raise RuntimeError("DoneSignal.wait() before arrive()")
        if self.work is not None:
            self.work.wait()
