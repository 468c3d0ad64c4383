"""Where a stage on a GPU computes: one thread and one CUDA stream of its own, not the RPC
agent's threads and streams (why, with what was measured: docs/architecture.md, "A
PipelineJob's step across its stages")."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar, TypeVarTuple

import torch

from pipejob.trainer.workloads.batch_values import tensors

T = TypeVar("T")
Args = TypeVarTuple("Args")


class GpuWorker:
    """A stage's thread and CUDA stream on `device`, which its computing runs on (`run`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pipejob-gpu")

    def run(self, fn: Callable[[*Args], T], *args: *Args) -> T:
        """`fn(*args)` on this worker's thread and stream, ordered after what the calling
        thread queued on its stream (the inputs it received) and before what it queues next
        (sending the result)."""
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        for t in tensors(args):
            if t.is_cuda:  # its memory stays until this stream is done with it
                t.record_stream(self.stream)

        def on_stream() -> T:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                return fn(*args)

        result = self._thread.submit(on_stream).result()
        caller.wait_stream(self.stream)
        return result

    def settle(self) -> None:
        """Wait for all the work queued on the device by this process, on any stream."""
        torch.cuda.synchronize(self.device)
