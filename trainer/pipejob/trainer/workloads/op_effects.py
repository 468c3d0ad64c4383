"""What torch's operations and calls do to their arguments, as the stand-ins of a build
(workloads/standins.py) need to know it: which overwrite their first argument, read only
shapes, read values into Python, or write arguments their schema does not declare; which
calls only read or set what a tensor is; and whether a tensor is all of its storage."""

from __future__ import annotations

from typing import Any

import torch

META = torch.device("meta")
aten = torch.ops.aten

# In-place operations that write all of their first argument without reading it.
OVERWRITES = {
    aten.uniform_,
    aten.normal_,
    aten.fill_,
    aten.zero_,
    aten.random_,
    aten.bernoulli_,
    aten.exponential_,
    aten.geometric_,
    aten.log_normal_,
    aten.cauchy_,
    aten.copy_,
}
# Operations that read only their arguments' shapes, not their values.
SHAPES_ONLY = {
    aten.empty_like,
    aten.new_empty,
    aten.new_empty_strided,
    aten.new_zeros,
    aten.new_ones,
    aten.new_full,
    aten.zeros_like,
    aten.ones_like,
    aten.full_like,
    aten.rand_like,
    aten.randn_like,
    aten.randint_like,
}
# Operations that read a tensor's values into Python (a branch may follow).
INTO_PYTHON = {aten._local_scalar_dense, aten.is_nonzero, aten.equal}

# Calls that read or set what a placeholder is (not its values), or convert it (which keeps
# it a placeholder: a conversion's result is on the meta device, _Operations): not swapped.
AS_IS = {
    "__get__",
    "__set__",
    "requires_grad_",
    "register_hook",
    "retain_grad",
    "to",
    "double",
    "float",
    "half",
    "bfloat16",
    "type",
    "cpu",
    "cuda",
    "type_as",
    "_has_compatible_shallow_copy_type",
}
# Calls that read a tensor's values into Python without an operation of torch's.
OUT_OF_TORCH = {"numpy", "tolist", "__array__"}


def meta_like(like: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=META)


def is_whole(value: Any) -> bool:
    """Whether a tensor is all of its storage (writing it replaces every value there)."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return False
    try:
        storage = value.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return False
    return value.storage_offset() == 0 and value.nbytes == storage.nbytes()


# Operations that write arguments their schema does not say they write: batch norm's
# running statistics (arguments 3 and 4), when it trains (argument 5).
_UNDECLARED = {aten.native_batch_norm, aten.cudnn_batch_norm, aten.miopen_batch_norm}


def written_arguments(func: Any, args: Any, kwargs: Any) -> list[Any]:
    """The arguments an in-place or out= operation writes."""
    if func.overloadpacket in _UNDECLARED:
        return list(args[3:5]) if len(args) > 5 and args[5] else []
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            written.append(value)
    return written


def is_meta(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "meta"
    return isinstance(value, torch.device) and value.type == "meta"
