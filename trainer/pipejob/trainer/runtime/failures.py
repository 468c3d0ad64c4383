"""How a failure is told: which ones a restart cannot cure, which ones a distributed world
expects, and in how many lines each is said.

Configuration errors the job would only repeat (core/contract.py PERMANENT_REASONS) fail the
job at once instead of spending its backoffLimit; anything else (a lost peer, an OOM kill, a
flaky network) is retried by restarting the world. Expected failures (a permanent one, a
peer lost, a timeout) are one line; an unexpected one is a bug and keeps its traceback."""

from __future__ import annotations

import re
import traceback

from pipejob.trainer.runtime import rpc_ledger
from pipejob.trainer.runtime.world import ContractError

# What torch says when tensors do not fit; an RPC error carries the remote message along.
_SHAPES = re.compile(
    r"shapes cannot be multiplied|size mismatch|must match the size of tensor"
    r"|Sizes of tensors must match|Given groups=|Expected input batch_size"
    r"|Calculated padded input size|Output size is too small|is invalid for input of size"
    r"|Expected more than 1 value per channel"
)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or does not fit this job (runtime/checkpoint.py);
    defined here, where torch is not imported yet, so that its verdict is known."""


class NonFiniteError(ArithmeticError):
    """A loss, gradient norm or model output that is NaN or infinite (runtime/nonfinite.py; a
    permanent failure); defined here for the same reason."""


def permanent_reason(error: BaseException) -> str | None:
    """The PERMANENT_REASONS key that `error` is an instance of, or None if retryable."""
    if isinstance(error, ContractError):
        return "BadEnvironment"
    if isinstance(error, NonFiniteError) or f"{NonFiniteError.__name__}: " in str(error):
        return "NonFinite"  # raised here, or in another process (its type in the text)
    if isinstance(error, CheckpointError):
        return "CheckpointUnusable"
    if isinstance(error, ImportError):
        return "ImportFailed"
    if _SHAPES.search(str(error)):
        return "ShapeMismatch"
    if isinstance(error, ValueError | TypeError):
        return "InvalidConfiguration"
    return None


# What torch (TensorPipe, gloo, the RPC agent, the store) says when a peer dies, freezes or
# leaves, or a distributed wait runs out: expected in a world whose member failed.
_LOST = re.compile(
    r"ECONNRESET|ECONNREFUSED|EPIPE|EOF: end of file|pipe closed|[Cc]onnection reset"
    r"|[Cc]onnection refused|[Cc]onnection closed by peer|[Bb]roken pipe"
    r"|RPC ran for more than set timeout|RPC agent .* shut ?down|[Ss]ocket [Tt]imeout"
    r"|[Tt]imed out|[Tt]imeout (was|of) |Connection lost|unreachable|Transport endpoint"
    r"|^eof \(this error originated at tensorpipe/transport/shm"  # TensorPipe's shm transport
)


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is what a world says when one of its members fails or stops: the
    cause is that member (whose own message says why), not this process."""
    return isinstance(error, TimeoutError | ConnectionError) or bool(_LOST.search(str(error)))


# How torch names the process a remote error came from, and a raised error's own line.
_REMOTE = re.compile(r"On WorkerInfo\(id=\d+, name=([^)]+)\)")
_RAISED = re.compile(r"^(\w+(?:Error|Exception|Exit|Interrupt)): (.+)$")


def one_line(error: BaseException) -> str:
    """`error` as one line, with where it was raised: "ValueError: bad size (at model.py:12
    in forward)"; an error from another process (torch's text of its traceback) as its
    innermost error and that process: "TypeError on stage0: bad arguments"."""
    text = str(error)
    remote = _REMOTE.search(text)
    raised = [m for line in text.splitlines() if (m := _RAISED.match(line.strip()))]
    if remote and raised:
        return f"{raised[-1][1]} on {remote[1]}: {' '.join(raised[-1][2].split())[:2000]}"
    said = " ".join(text.split())
    text = f"{type(error).__name__}: {said[:2000]}" if said else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name})"
    return text


def say_remote_errors_in_one_line() -> None:
    """torch prints the traceback of every exception that a function called over RPC raises,
    before sending it back (torch.distributed.rpc.internal._run_function, which the RPC agent
    looks up when it starts: call this before init_rpc). Here an expected one (a peer lost, a
    permanent configuration error) travels back as one line and is not printed: the caller
    says it; a bug keeps torch's printed traceback."""
    import sys

    from torch.distributed.rpc import internal

    def run_function(python_udf):  # torch 2.13's _run_function, with expected errors said once
        try:
            if isinstance(python_udf, AttributeError):
                raise python_udf
            return python_udf.func(*python_udf.args, **python_udf.kwargs)
        except Exception as e:
            where = f"On {internal._get_current_rpc_agent().get_worker_info()}:\n"
            if lost_peer(e) or permanent_reason(e) is not None:
                return internal.RemoteException(f"{where}{one_line(e)}", type(e))
            said = f"{where}{e!r}\n{traceback.format_exc()}"
            print(said, file=sys.stderr)
            return internal.RemoteException(said, type(e))
        finally:
            rpc_ledger.served()  # the watchdog counts the calls that end (runtime/rpc_ledger.py)

    internal._run_function = run_function
