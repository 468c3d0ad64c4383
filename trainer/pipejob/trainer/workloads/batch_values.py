"""A batch's inputs, labels or outputs as the data and the model give them: a tensor, or a
dict, tuple or list of tensors (an audio seq2seq model's {input_features,
decoder_input_ids}, a label dict, a (logits, sparsity loss) output), taken apart by samples
along each tensor's first dimension as one process's batch would be, and what a value
beside the batch (a 0-dim loss, None) is over the micro-batches (`beside`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# The keyword arguments a user's module is called with (the model's own, whatever they hold;
# torch's forward pre-hook gives them so): the user's model's boundary.
ForwardKwargs = dict[str, Any]


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value a stage passes on or a model returns: a tensor, or a tuple,
    list or dict (a ModelOutput too) holding them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []


def samples(value: Any, dim_only: bool = False) -> int:
    """The batch's samples: the first dimension of its first tensor (1 for none); with
    `dim_only`, of its first tensor that has one (an output may hold a 0-dim loss first)."""
    for t in tensors(value):
        if t.dim() or not dim_only:
            return len(t) if t.dim() else 1
    return 1


def take(value: Any, n: int) -> Any:
    """The first `n` samples of every tensor in `value`."""
    return _each(value, lambda t: t[:n] if t.dim() else t)


def first(value: Any) -> Any:
    """The first sample of every tensor in `value` (a sample's shapes, for a message)."""
    return _each(value, lambda t: t[0] if t.dim() else t)


def split(value: Any, parts: int) -> list[Any]:
    """`value` as `parts` consecutive pieces by samples (tensor_split's sizes)."""
    if isinstance(value, torch.Tensor):
        return list(value.tensor_split(parts))
    if isinstance(value, dict):
        pieces = {k: split(v, parts) for k, v in value.items()}
        return [type(value)(**{k: p[i] for k, p in pieces.items()}) for i in range(parts)]
    if isinstance(value, tuple | list):
        columns = [split(v, parts) for v in value]
        return [type(value)(c[i] for c in columns) for i in range(parts)]
    return [value] * parts


def to(value: Any, device: torch.device | str) -> Any:
    """Every tensor in `value` on `device`."""
    return _each(value, lambda t: t.to(device))


def pinned(value: Any) -> Any:
    """Every tensor in `value` in page-locked memory (those that are not yet)."""
    return _each(value, lambda t: t if t.is_pinned() else t.pin_memory())


def beside(values: list[Any], sizes: list[int]) -> Any:
    """A value beside the batch (a 0-dim loss, None, a Python value) over the micro-batches
    of `sizes` samples: a floating 0-dim tensor is their mean weighted by their samples (one
    process's value where it is a mean over the batch's samples: a sparsity or auxiliary
    loss); any other value is itself where every micro-batch computed the same (None, a
    flag), else the list of the micro-batches' values."""
    one = values[0]
    if len(values) == 1:
        return one
    if isinstance(one, torch.Tensor) and one.is_floating_point():
        weights = torch.tensor(sizes, dtype=one.dtype, device=one.device)
        return (torch.stack(values) * weights).sum() / weights.sum()
    if all(_same(v, one) for v in values):
        return one
    return list(values)


@dataclass(frozen=True)
class Subclassed:
    """A tensor subclass's instance (MONAI's MetaTensor) as it crosses to another process:
    its data as a plain tensor, which torch's RPC carries with its autograd link (it
    pickles a subclass inline, without one: the gradient never came back), its class and
    its attributes (`dressed` makes it again)."""

    plain: torch.Tensor
    kind: type
    attributes: dict[str, Any]


def undressed(value: Any) -> Any:
    """Every tensor subclass's instance in `value` as a `Subclassed`."""
    if isinstance(value, tuple | list | dict):
        return _each(value, undressed, containers_only=True)
    if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, nn.Parameter):
        with torch._C.DisableTorchFunctionSubclass():  # its own class would come back
            plain = value.as_subclass(torch.Tensor)  # a view: the autograd link is kept
        return Subclassed(plain, type(value), dict(vars(value)))
    return value


def dressed(value: Any) -> Any:
    """`value` with each `Subclassed` an instance of its class again, as one process has it."""
    if isinstance(value, tuple | list | dict):
        return _each(value, dressed, containers_only=True)
    if isinstance(value, Subclassed):
        with torch._C.DisableTorchFunctionSubclass():
            again = value.plain.as_subclass(value.kind)
        vars(again).update(value.attributes)
        return again
    return value


def unlinked(received: Any) -> str | None:
    """What of a value passed on from another stage, before this stage computed anything
    with it, arrived without its autograd link, so no gradient can go back: its type; None
    where every link holds. A linked tensor's history begins at torch's receive (no leaf
    behind it); one torch's RPC pickled inline (a subclass it was not told of) is, or is a
    view of, a leaf that needs a gradient."""
    for t in tensors(received):
        if t.requires_grad and _reaches_a_leaf(t.grad_fn):
            return type(t).__name__
    return None


# The nodes an unpickled value's history can hold before its leaf: views and aliases of it
# (as_subclass is an alias). Anything computed (a stage's own step, a test's `x * 2`) is not
# how a value arrives.
_VIEWS = ("Alias", "View", "UnsafeView", "AsStrided")


def _reaches_a_leaf(node: Any) -> bool:
    """Whether an autograd history is a leaf that needs a gradient, or a view of one."""
    looked = 0
    while node is not None and looked < 64:  # a received value's history is a node or two
        name, looked = type(node).__name__, looked + 1
        if name == "AccumulateGrad":
            return True
        if not name.startswith(_VIEWS):
            return False
        node = next((n for n, _ in node.next_functions if n is not None), None)
    return node is None  # the tensor is such a leaf itself


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return a is b or bool(a == b)
    except Exception:  # a value whose == is not a truth value
        return False


def _each(value: Any, fn: Any, containers_only: bool = False) -> Any:
    """`fn` of every tensor in `value` (of every item, with `containers_only`)."""
    step = fn if containers_only else (lambda v: _each(v, fn))
    if isinstance(value, dict):
        return type(value)(**{k: step(v) for k, v in value.items()})
    if isinstance(value, tuple | list):
        return type(value)(step(v) for v in value)
    if isinstance(value, torch.Tensor):
        return fn(value)
    return value
