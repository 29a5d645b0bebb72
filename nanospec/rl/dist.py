"""Small torch.distributed helpers: one process per rank (torchrun, or mp.spawn in tests).

Without an initialised process group everything acts as world size 1, so the trainer and the
rollout worker keep one code path. gloo on CPU, nccl on GPU.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK). Node-local things key on it (the GPU,
    the one writer per node of the model cache / conversion and the SFT model); global things on
    `rank()` (metrics, checkpoints: those need a filesystem every node sees, as DCP does)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Init the default group from torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR/PORT) when
    WORLD_SIZE > 1 -> (rank, world_size). nccl also pins this process to GPU LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not is_dist():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        device = None
        if backend == "nccl":     # bound to its GPU: collectives and barrier() need not guess the device
            device = torch.device("cuda", local_rank())
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
    return rank(), world_size()


def all_gather_object(obj, group=None) -> list:
    """[obj of rank 0, obj of rank 1, ...] for picklable objects; [obj] without a process group."""
    if not is_dist():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def new_group():
    """A second group over every rank (collective): a thread that runs collectives alongside the main
    thread needs its own, or the two threads' calls could pair up out of order across ranks."""
    return dist.new_group() if is_dist() else None


def barrier() -> None:
    if is_dist():
        dist.barrier()


def cleanup(sync: bool = True) -> None:
    """Leave the process group. `sync`: barrier first, so that rank 0, which hosts the TCPStore, does
    not tear it down while another rank is still finishing (seen as a SIGABRT "terminate called
    without an active exception" in that rank). Pass False on an error path: a barrier would hang."""
    if is_dist():
        if sync:
            dist.barrier()
        dist.destroy_process_group()


class DoneSignal:
    """Non-blocking 'every rank has arrived': an early rank keeps working (bubble drafting) and polls
    `done()` between engine steps instead of blocking in a barrier.

    A counter in the process group's key-value store (torchrun's TCPStore; any backend): `arrive()`
    adds 1 and so learns whether this rank came *last* -- then it must start no extra work, everyone
    waits for it -- and the last one sets a flag key that `done()` checks (one small TCP round trip)
    and `wait()` blocks on. (An async all-reduce polled with `work.is_completed()` works on gloo too,
    but cannot tell the last rank that it is last: the straggler would start a bubble step first.)
    Ranks must create their signals in the same order: the n-th signal of every rank shares key n.
    """
    _created = 0

    def __init__(self):
        DoneSignal._created += 1
        self.key = f"nanospec/done/{DoneSignal._created}"
        self.arrived = self.last = False
        self.store = None

    def arrive(self) -> None:
        if self.arrived:
            raise RuntimeError("DoneSignal.arrive() called twice")
        self.arrived = True
        if not is_dist():
            self.last = True
            return
        self.store = dist.distributed_c10d._get_default_store()
        self.last = self.store.add(self.key, 1) == world_size()
        if self.last:
            self.store.set(self.key + "/all", "1")

    def done(self) -> bool:
        if not self.arrived:
            raise RuntimeError("DoneSignal.done() before arrive()")
        return self.last or self.store.check([self.key + "/all"])

    def wait(self) -> None:
        if not self.done():
            self.store.wait([self.key + "/all"])


def all_reduce_grads(params: list, bucket_numel: int = 1 << 24) -> None:
    """SUM every gradient over ranks (exact; no-op without a process group), a few large all_reduces
    through flat buckets of <= `bucket_numel` elements (64 MiB in fp32, as DDP's buckets): few calls,
    and never a second copy of the whole gradient (for a real model that is another copy of the weights)."""
    if not is_dist():
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket, size = [], 0
    for i, p in enumerate(params):
        bucket.append(p)
        size += p.numel()
        if size >= bucket_numel or i == len(params) - 1:
            flat = torch.cat([q.grad.flatten() for q in bucket])
            torch.distributed.all_reduce(flat)
            for q, g in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad.copy_(g.view_as(q))
            bucket, size = [], 0


def hash_seed(*parts) -> int:
    """A stable 63-bit seed from anything printable (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(), "big") >> 1


def user_error(e: Exception) -> int:
    """argparse's convention for bad input: one line on stderr, exit status 2.

    Under torchrun every rank validates the same inputs and fails alike, and torchrun SIGTERMs the
    other ranks as soon as one exits. So no fixed rank can be trusted to print: the first rank to
    claim a marker file of this launch prints the line, then marks it printed;
    the others exit only once it is printed, so torchrun's teardown can never cut the line off. A rank
    that never sees it printed (the printer died) prints its own after 30 s. The marker lives in
    torchrun's own directory of this attempt, shared by the ranks of this node."""
    if os.environ.get("NANOSPEC_TRACEBACK"):
        raise e
    msg = str(e.args[0]) if isinstance(e, FileNotFoundError) and e.args else str(e)
    line = f"train.py: error: {msg}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")    # torchrun: <attempt dir>/<rank>/error.json
    if error_file is None:                        # one process: nobody to race
        print(line, file=sys.stderr, flush=True)
        return 2
    marker = os.path.join(os.path.dirname(os.path.dirname(error_file)), "nanospec_user_error")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:                       # another rank prints it: wait until it has
        deadline = time.monotonic() + 30
        while not os.path.exists(marker + ".printed"):
            if time.monotonic() > deadline:
                print(line, file=sys.stderr, flush=True)
                break
            time.sleep(0.01)
        return 2
    print(line, file=sys.stderr, flush=True)
    os.close(os.open(marker + ".printed", os.O_CREAT | os.O_WRONLY))
    return 2
