"""The order a stage of the rpc engine runs its micro-batches' backwards in, whatever the order
their gradients reach it in (pipeline/rpc/stage.py): one at a time, in micro-batch order.

Distributed autograd runs each micro-batch's backward through a stage as its gradient arrives,
several at once on the autograd threads. The stage adds its parameters' gradients in
micro-batch order whatever the order (gradient_sum.py), but one that comes early is held until
those before it are done: in order, each is added as it comes and none is held. A
micro-batch's backward that comes early waits on its autograd thread (at its first node) until
those before it have run: the stage gives distributed autograd a thread for every micro-batch
of a round (`interop_threads`), so the one whose turn it is always has one."""

from __future__ import annotations

import threading


def interop_threads(most_micro_batches: int, now: int) -> int:
    """The inter-op threads (torch.set_num_interop_threads: distributed autograd runs each
    arriving gradient's backward on one) a stage needs so that a round's `most_micro_batches`
    backwards can all wait for their turn and the one whose turn it is still runs; at least
    `now`."""
    return max(now, most_micro_batches + 1)


class BackwardOrder:
    """Per round: the micro-batches whose backward has run through this stage (or that had
    none). Micro-batch m's backward starts once those before it (0 to m - 1) have run. A turn
    that does not come within `timeout` is an error, not a hang."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._changed = threading.Condition()
        self._done: dict[int, set[int]] = {}  # per round

    def wait(self, round: int, micro_batch: int) -> None:
        """Block until every micro-batch before `micro_batch` in round `round` has finished
        its backward here."""

        def missing() -> list[int]:
            done = self._done.get(round, set())
            return [m for m in range(micro_batch) if m not in done]

        with self._changed:
            if not self._changed.wait_for(lambda: not missing(), self.timeout):
                raise TimeoutError(
                    f"the backward of micro-batch {micro_batch} of round {round} waited"
                    f" {self.timeout:g}s for those of micro-batches {missing()}"
                )

    def done(self, round: int, micro_batch: int) -> None:
        """Micro-batch `micro_batch` of round `round` has finished its backward here (or has
        none)."""
        with self._changed:
            self._done.setdefault(round, set()).add(micro_batch)
            self._changed.notify_all()

    def forget(self, before: int) -> None:
        """Forget the rounds before round `before`."""
        with self._changed:
            self._done = {r: d for r, d in self._done.items() if r >= before}
