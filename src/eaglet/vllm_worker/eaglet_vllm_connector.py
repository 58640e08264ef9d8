"""vLLM's hidden-state connector, made to run on a CPU (imported by vLLM inside its own venv).

vLLM's `extract_hidden_states` method caches the target's states at the requested layers in a
cache-only attention layer; its `ExampleHiddenStatesConnector` copies a finished request's slots
out of that cache and writes `<request_id>.safetensors` (`hidden_states` [T, layers, H],
`token_ids` [T]). On a CPU the stock copy dies: it pins host memory (`pin_memory=True requires a
CUDA or other accelerator backend`) on a CUDA copy stream, then polls a CUDA event that vLLM's CPU
placeholder lacks. This subclass does the same copy synchronously on the cache's own device and
writes the same file, atomically (a temp name renamed into place), then releases the request's
lock exactly as the stock writer does; everything else (which slots, which file, the lock that
readers wait on, the one writer per tensor-parallel group) is vLLM's own code.

Loaded by name: `"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path":
"eaglet_vllm_connector"` with this folder on PYTHONPATH.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class WrittenEvent:
    """What the stock connector polls (`event.query()`) to report a request done: the copy and
    the write happened before this is stored, so it is always done."""

    def query(self) -> bool:
        return True


def slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    """The cache slots of a request's blocks, in token order."""
    blocks = torch.tensor(block_ids, dtype=torch.long).reshape(-1, 1)
    return (blocks * block_size + torch.arange(block_size, dtype=torch.long).reshape(1, -1)).flatten()


def write_atomically(tensors: dict[str, torch.Tensor], filename: str) -> None:
    """The file appears complete or not at all: a reader never sees a torn one."""
    tmp = f"{filename}.tmp-{os.getpid()}"
    save_file(tensors, tmp)
    os.replace(tmp, filename)


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a synchronous copy and write (see the module's words)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        slots = slot_mapping(pending.block_ids, self._block_size).to(self._kv_cache.device)
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).to("cpu").contiguous()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            write_atomically({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the exclusive lock readers wait on
        self._req_copy_events[pending.req_id] = WrittenEvent()
