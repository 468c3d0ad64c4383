"""The bounds the runtime enforces on what a spec hands to torch (an optimizer's settings, the
dtypes a name stands for, the class a schedule runs), in one torch-free table the spec tables
take their minimum and maximum from: `pipejob validate` refuses exactly what a process would
fail on at start. docs/architecture.md, "The spec and its validation, part by part"."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipejob.core.schema import Rule


@dataclass(frozen=True)
class Range:
    """An interval of floats; either end may be open, absent, or pipejob's own."""

    minimum: float | None = None
    exclusive_minimum: bool = False
    maximum: float | None = None
    exclusive_maximum: bool = False
    own_minimum: bool = False  # torch accepts values below the minimum (pipejob does not)
    own_maximum: bool = False

    def contains(self, value: float) -> bool:
        """Whether `value` lies in the range (NaN never does)."""
        if math.isnan(value):
            return False
        low, high = self.minimum, self.maximum
        above = low is None or (value > low if self.exclusive_minimum else value >= low)
        below = high is None or (value < high if self.exclusive_maximum else value <= high)
        return above and below

    def in_words(self) -> str:
        """The range as a message says it: `>= 0`, `in [0, 1)`."""
        low, high = self.minimum, self.maximum
        if high is None:
            return f"{'>' if self.exclusive_minimum else '>='} {low:g}"
        if low is None:
            return f"{'<' if self.exclusive_maximum else '<='} {high:g}"
        left, right = "(" if self.exclusive_minimum else "[", ")" if self.exclusive_maximum else "]"
        return f"in {left}{low:g}, {high:g}{right}"

    def cel(self, expression: str) -> str:
        """The range as a CEL condition on `expression`."""
        parts = []
        if self.minimum is not None:
            parts.append(f"{expression} {'>' if self.exclusive_minimum else '>='} {self.minimum!r}")
        if self.maximum is not None:
            parts.append(f"{expression} {'<' if self.exclusive_maximum else '<='} {self.maximum!r}")
        return " && ".join(parts) or "true"

    def schema(self) -> dict[str, float | bool | None]:
        """The range as a spec Field's keyword arguments."""
        return {
            "minimum": self.minimum,
            "exclusive_minimum": self.exclusive_minimum,
            "maximum": self.maximum,
            "exclusive_maximum": self.exclusive_maximum,
        }

    def inside_edges(self) -> list[float]:
        """The values just inside each end (the edge itself where it is closed)."""
        out = []
        if self.minimum is not None:
            low = self.minimum
            out.append(math.nextafter(low, math.inf) if self.exclusive_minimum else low)
        if self.maximum is not None:
            high = self.maximum
            out.append(math.nextafter(high, -math.inf) if self.exclusive_maximum else high)
        return out

    def outside_values(self) -> list[tuple[float, bool]]:
        """The values just outside each end, each with whether torch refuses it too."""
        out = []
        if self.minimum is not None:
            low = self.minimum
            value = low if self.exclusive_minimum else math.nextafter(low, -math.inf)
            out.append((value, not self.own_minimum))
        if self.maximum is not None:
            high = self.maximum
            value = high if self.exclusive_maximum else math.nextafter(high, math.inf)
            out.append((value, not self.own_maximum))
        return out


AT_LEAST_0 = Range(0.0)  # torch.optim's `if not 0.0 <= value: raise ValueError`
ABOVE_0 = Range(0.0, exclusive_minimum=True)  # SparseAdam's lr and eps: `0.0 < value`
BETA = Range(0.0, maximum=1.0, exclusive_maximum=True)  # Adam's betas: `0.0 <= beta < 1.0`
# pipejob's: a zero learning rate trains nothing (torch takes it).
LEARNING_RATE = Range(0.0, exclusive_minimum=True, own_minimum=True)
# pipejob's upper end: a momentum over 1 grows every step without bound (torch takes it).
MOMENTUM = Range(0.0, maximum=1.0, own_maximum=True)

_BETAS = {"beta1": BETA, "beta2": BETA}
# spec.optimizer, by name: the torch.optim class it builds (trainer/runtime/optim.py), and the
# bound of each spec field that class receives (the spec's name: momentum only where used).
OPTIMIZERS: dict[str, tuple[str, dict[str, Range]]] = {
    "sgd": ("SGD", {"lr": LEARNING_RATE, "momentum": MOMENTUM, "weightDecay": AT_LEAST_0}),
    "adam": ("Adam", {"lr": LEARNING_RATE, "weightDecay": AT_LEAST_0, **_BETAS}),
    "adamw": ("AdamW", {"lr": LEARNING_RATE, "weightDecay": AT_LEAST_0, **_BETAS}),
    "rmsprop": ("RMSprop", {"lr": LEARNING_RATE, "momentum": MOMENTUM, "weightDecay": AT_LEAST_0}),
}

# spec.sparseOptimizer, by name: the class a parameter server builds
# (trainer/hybrid/sparse_optimizers.py) and the bound of each spec field it receives.
# rowwiseAdagrad is pipejob's own class: it checks nothing itself and takes Adagrad's bounds
# (own: torch has no class to refuse).
_ADAGRAD = {"lr": LEARNING_RATE, "eps": AT_LEAST_0, "initialAccumulatorValue": AT_LEAST_0}
_ROWWISE = {name: Range(**bound.schema(), own_minimum=True) for name, bound in _ADAGRAD.items()}
SPARSE_OPTIMIZERS: dict[str, tuple[str, dict[str, Range]]] = {
    "sgd": ("SGD", {"lr": LEARNING_RATE}),
    "adagrad": ("Adagrad", _ADAGRAD),
    "rowwiseAdagrad": ("RowWiseAdagrad", _ROWWISE),
    "adam": ("SparseAdam", {"lr": ABOVE_0, "eps": ABOVE_0, "beta1": BETA, "beta2": BETA}),
}
# Each sparse optimizer's eps unless the spec gives one: torch's Adagrad's and SparseAdam's.
SPARSE_EPS = {"sgd": 0.0, "adagrad": 1e-10, "rowwiseAdagrad": 1e-10, "adam": 1e-8}


def loosest(table: dict[str, tuple[str, dict[str, Range]]], field: str) -> Range:
    """The widest range any name of `table` gives `field`: the spec Field's own bound (a
    name's narrower one is a rule, `narrower`)."""
    ranges = [bounds[field] for _, bounds in table.values() if field in bounds]
    low = min(
        ranges, key=lambda r: (-math.inf if r.minimum is None else r.minimum, r.exclusive_minimum)
    )
    high = max(
        ranges,
        key=lambda r: (math.inf if r.maximum is None else r.maximum, not r.exclusive_maximum),
    )
    return Range(low.minimum, low.exclusive_minimum, high.maximum, high.exclusive_maximum)


def narrower(table: dict[str, tuple[str, dict[str, Range]]], field: str) -> dict[str, Range]:
    """The names whose range of `field` is narrower than the loosest: each needs a rule."""
    wide = loosest(table, field)
    return {
        name: bounds[field]
        for name, (_, bounds) in table.items()
        if field in bounds and bounds[field].schema() != wide.schema()
    }


def name_rules(table: dict[str, tuple[str, dict[str, Range]]], field: str) -> tuple[Rule, ...]:
    """A rule for each name whose range of `field` is narrower than the Field's own bound."""
    return tuple(
        _name_rule(name, table[name][0], field, bound)
        for name, bound in narrower(table, field).items()
    )


def _name_rule(name: str, cls: str, field: str, bound: Range) -> Rule:
    return Rule(
        f"!has(self.{field}) || self.name != '{name}' || ({bound.cel(f'self.{field}')})",
        f"{field} must be {bound.in_words()} with {name} (torch's {cls} refuses any other)",
        field,
        lambda o: field not in o or o["name"] != name or bound.contains(o[field]),
    )


# The dtypes a spec's names stand for: torch's (spec.precision: what autocast computes in;
# None is no autocast) and numpy's (spec.data.tokens.dtype: one token id in the file).
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
TOKEN_DTYPES = {"uint16": "uint16", "uint32": "uint32"}

# spec.schedule: the torch.distributed.pipelining class each name runs.
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}
