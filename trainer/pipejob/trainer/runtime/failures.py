"""Which failures a restart cannot cure: configuration errors the job would only repeat
(core/contract.py PERMANENT_REASONS). The operator fails such a job at once instead of
spending its backoffLimit; anything else (a lost peer, an OOM kill, a flaky network) is
retried by restarting the world."""

from __future__ import annotations

import re

from pipejob.trainer.runtime.world import ContractError

# What torch says when tensors do not fit; an RPC error carries the remote message along.
_SHAPES = re.compile(
    r"shapes cannot be multiplied|size mismatch|must match the size of tensor"
    r"|Sizes of tensors must match|Given groups=|Expected input batch_size"
    r"|Calculated padded input size|Output size is too small|is invalid for input of size"
    r"|Expected more than 1 value per channel"
)


def permanent_reason(error: BaseException) -> str | None:
    """The PERMANENT_REASONS key that `error` is an instance of, or None if retryable."""
    if isinstance(error, ContractError):
        return "BadEnvironment"
    if isinstance(error, ImportError):
        return "ImportFailed"
    if _SHAPES.search(str(error)):
        return "ShapeMismatch"
    if isinstance(error, ValueError | TypeError):
        return "InvalidConfiguration"
    return None
