"""Refusals in the user's terms: what failed, at which line of the model's own source (the
deepest frame outside torch, fx, pipejob and the libraries that only check what they are
given, such as einops), and the way past."""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

# Code that is not the model's: torch's (fx's too), pipejob's own, and the libraries a
# model calls that check what they are given (einops): an error is shown at the deepest
# line outside them, the model's own.
_NOT_THE_MODELS = ("/torch/", "/einops/", str(Path(__file__).resolve().parents[1]) + "/")


_STANDARD_LIBRARY = sysconfig.get_paths()["stdlib"] + "/"


def _the_models(filename: str) -> bool:
    if any(part in filename for part in _NOT_THE_MODELS):
        return False
    installed = "site-packages" in filename or "dist-packages" in filename
    return installed or not filename.startswith(_STANDARD_LIBRARY)  # not contextlib's


def where(error: BaseException) -> str:
    """The line of the model's own source (or its library's) an error came from:
    ` at modeling_bert.py:85: position_ids = self.position_ids[:, a:b]`; "" if none."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _the_models(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno}: {(f.line or '').strip()}"


def construct(error: BaseException) -> str:
    """What failed, and where in the user's (or the library's) code: `TypeError: ... at
    modeling_bert.py:85: position_ids = self.position_ids[:, a:b]`."""
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first}{where(error)}"


def way_past(module: str = "") -> str:
    """What a user whose model the tracer cannot read can do."""
    outside = f" outside {module} (spec.splitPoints)" if module else " (spec.splitPoints)"
    return (
        f"the way past: a split point{outside} where the code between modules traces,"
        " or say how the model is staged (spec.model.staged: its modules in order, or a"
        " function that builds stage i of n: the user guide's 'Past the tracer')"
    )


def kept_whole(whole: dict[str, str]) -> str:
    """Why modules were kept whole: `; blocks is kept whole (TraceError: ... at x.py:12: ...)`."""
    return "".join(f"; {name} is kept whole ({why})" for name, why in whole.items())
