"""Several processes under `torchrun`: each takes every W-th micro-batch of the same global order
and DDP averages the gradients, so W processes with accumulation A match one process with
accumulation A*W. With WORLD_SIZE unset (one process) nothing here starts a process group."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from eaglet.target import pick_device


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def from_main(self, value: int) -> int:
        """Rank 0's value on every rank (decisions made from timings must agree)."""
        if self.world == 1:
            return value
        t = torch.tensor([value if self.main else 0], dtype=torch.long, device=self.device_for_collectives())
        dist.broadcast(t, 0)
        return int(t.item())

    def device_for_collectives(self) -> torch.device:
        backend = dist.get_backend()
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def init_distributed(device: torch.device) -> Dist:
    """Join the process group when started by torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def process_device(name: str | None) -> torch.device:
    """The device of this process: `name` (default: cuda if available); under torchrun on CUDA,
    one device per process, the one LOCAL_RANK names."""
    device = pick_device(name)
    if device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return device


def env_rank() -> int:
    """This process's rank as torchrun sets it, before the process group is joined (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def wrap(draft: nn.Module, device: torch.device, group: Dist) -> nn.Module:
    """The module the loop runs: the drafter itself, or under torchrun its DDP wrapper."""
    if group.world == 1:
        return draft
    return DDP(draft, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)


def teardown(group: Dist) -> None:
    """Leave the process group at the end of a run; the caller has dropped its DDP wrapper."""
    if group.world > 1:
        # DDP's reducer holds the gloo/NCCL group and its work objects in reference cycles; free them
        # while the interpreter is alive: freed at exit, a gloo thread can abort the process (SIGABRT)
        gc.collect()
        dist.destroy_process_group()


def host_memory() -> str:
    """This process's resident and peak host memory (/proc/self/status), e.g. "RSS 5.10 GB (peak
    5.31 GB)": printed per rank at start, since every rank holds its own copy of what it reads."""
    status = Path("/proc/self/status")
    if not status.exists():
        return "RSS unknown"
    kib = {
        k: int(v.split()[0])
        for k, v in (line.split(":", 1) for line in status.read_text().splitlines())
        if k in ("VmRSS", "VmHWM")
    }
    return f"RSS {kib.get('VmRSS', 0) * 1024 / 1e9:.2f} GB (peak {kib.get('VmHWM', 0) * 1024 / 1e9:.2f} GB)"
