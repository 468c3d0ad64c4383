"""Refusals in the user's terms: what failed, at which line of the model's own source (the
deepest frame outside torch, fx, pipejob and the libraries that only check what they are
given, such as einops), and the way past."""

from __future__ import annotations

import functools
import sysconfig
import traceback
from pathlib import Path
from types import TracebackType

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


@functools.cache
def _installed(filename: str) -> bool:
    """Whether a file is an installed library's: under site-packages, or in a package
    beside a distribution's metadata (`pip install --target DIR`)."""
    if "site-packages" in filename or "dist-packages" in filename:
        return True
    folder = Path(filename).parent
    while (folder / "__init__.py").exists() and folder.parent != folder:
        folder = folder.parent  # up to the folder holding the top-level package
    return folder != Path(filename).parent and any(folder.glob("*.dist-info"))


def _nearest(filenames: list[str]) -> int | None:
    """Which of a traceback's frames (by their files, outermost first) is nearest the
    user's code: the deepest in the user's own files; else the deepest in a library the
    model comes from (a transformers model's forward); None if none is either."""
    for chosen in (lambda f: _the_models(f) and not _installed(f), _the_models):
        found = [i for i, f in enumerate(filenames) if chosen(f)]
        if found:
            return found[-1]
    return None


def where(error: BaseException) -> str:
    """The line nearest the user's code an error came from (`_nearest`): the user's call
    into a library that raised, or the model's own library's line: ` at
    modeling_bert.py:85: position_ids = self.position_ids[:, a:b]`; "" if none."""
    frames = traceback.extract_tb(error.__traceback__)
    k = _nearest([f.filename for f in frames])
    if k is None:
        return ""
    f = frames[k]
    return f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno}: {(f.line or '').strip()}"


def to_users_frame(error: BaseException) -> TracebackType | None:
    """`error`'s traceback ending at the frame nearest the user's code (`_nearest`), for an
    error raised again in pipejob's words: where a failure's one line says it was raised
    (runtime/failures.one_line) is then the user's line, not pipejob's or a library's."""
    tbs = []
    tb = error.__traceback__
    while tb is not None:
        tbs.append(tb)
        tb = tb.tb_next
    k = _nearest([t.tb_frame.f_code.co_filename for t in tbs])
    if k is None:
        return error.__traceback__
    rebuilt = None
    for t in reversed(tbs[: k + 1]):
        rebuilt = TracebackType(rebuilt, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return rebuilt


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


def reads_python_state(model: str, read: str) -> str:
    """A forward that reads a tensor a module's forward writes into a Python list or dict
    as it runs (DynUNet's deep-supervision heads), which a trace would fix as a constant."""
    return (
        f"cannot cut {model}: its forward reads {read}, a tensor held in a Python list or"
        " dict, which a module's forward writes as it runs (deep supervision's heads): the"
        f" trace would fix its value; {way_past()}"
    )
