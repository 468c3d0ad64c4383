"""What a job kind is: its Kubernetes names, its spec table, the roles of its world and the
groups they form, and the trainer module that runs its roles. Each kind declares one `Kind`
(core/kinds/); the CRDs, the world plan, the operator, the runner and the trainer read it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from pipejob.core.elastic import Size
from pipejob.core.errors import SpecError
from pipejob.core.schema import Field

if TYPE_CHECKING:  # common_spec.py reads the elastic sizes this module's kinds declare
    from pipejob.core.common_spec import CommonSpec

# The spec as the manifest has it (camelCase), while the parser defaults, completes and checks
# it, and as the pods get it (Job.spec's JSON); past the parser, code reads the kind's typed
# settings (Job.settings) instead.
RawSpec = dict[str, Any]


@dataclass(frozen=True)
class Role:
    """Processes of one kind of work in a world, e.g. the stages of a pipeline."""

    name: str  # master | stage | ps | trainer
    # The settings' field (its kind's, core/kinds/) with how many members; None: exactly one.
    count: str | None = None
    # The settings' field with the copies of the role's members (PipelineJob replicas), whose
    # names carry the replica; None: one copy.
    replicas: str | None = None
    gpus: str | None = None  # the settings' field with the GPUs of each of its pods
    computes: bool = False  # does the model's arithmetic (gets the cores, see tuning)
    # Bound by the latency of many small RPCs: keeps TensorPipe's busy-polling transport.
    latency_bound: bool = False
    # (a boolean settings field, a role): where the field is true, the members run inside that
    # role's processes, one in each (a HybridJob's servers in its trainers), none of their own.
    inside: tuple[str, str] | None = None
    # One intra-op thread, not twice its share, where its share is a core or less: more
    # samples per CPU-second for it (runtime/tuning.py; docs/user-guide.md, "Threads"). The
    # trainer's tuning asks it of the spec its env carries (Job.spec's JSON).
    one_thread_when_crowded: Callable[[RawSpec], bool] = lambda spec: False

    def members(self, world: CommonSpec) -> int:
        """Members of one replica with processes of their own (none when hosted), in a world of
        these settings (Job.shape)."""
        if self.inside is not None and getattr(world, self.inside[0]):
            return 0
        return 1 if self.count is None else world_size(getattr(world, self.count))

    def hosted(self, spec: RawSpec) -> str | None:
        """The role whose processes run this role's members under the spec its env carries
        (the trainer's tuning reads it); None: their own."""
        inside = self.inside
        return inside[1] if inside is not None and spec.get(spec_key(inside[0])) else None

    def copies(self, world: CommonSpec) -> int:
        """Copies of the role's members in a world of these settings: its replicas, or 1."""
        return 1 if self.replicas is None else world_size(getattr(world, self.replicas))

    def rpc_name(self, index: int, replica: int = 0, replicated: bool = False) -> str:
        """The RPC worker name: the role's name for a single member, else with its index;
        with replicas, prefixed by the replica (r1-stage0)."""
        name = self.name if self.count is None else f"{self.name}{index}"
        return f"r{replica}-{name}" if replicated else name


@dataclass(frozen=True)
class ProcessGroup:
    """A collective process group (DDP) that the members of one role form beside the RPC
    world, with a rendezvous of its own on its rank 0. With `by_index`, the members with the
    same index (stage i of every replica) form one group each, named `<name><index>`."""

    name: str
    role: str
    backend: Callable[[Any], str]  # gloo or nccl, in a world of the kind's settings
    by_index: bool = False
    when: Callable[[Any], bool] = lambda world: True  # formed only when this holds


class PrinterColumn(TypedDict, total=False):
    """A CRD's additionalPrinterColumns entry (a column of `kubectl get`)."""

    name: str
    type: str
    jsonPath: str
    priority: int
    description: str


def column(name: str, type: str, json_path: str, description: str = "") -> PrinterColumn:
    """A column of a kind's own in `kubectl get -o wide` (priority 1)."""
    out = PrinterColumn(name=name, type=type, jsonPath=json_path, priority=1)
    return out | PrinterColumn(description=description) if description else out


def world_size(value: int | Size) -> int:
    """A count of the settings of a world: a number, or its elastic size, which Job.shape
    has made one number."""
    return value.max if isinstance(value, Size) else value


def spec_key(name: str) -> str:
    """The spec key of a settings field: weight_decay -> weightDecay."""
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)


@dataclass(frozen=True)
class Kind:
    name: str  # PipelineJob
    plural: str  # pipelinejobs
    short_name: str  # pj
    description: str  # the CRD's
    spec: Field  # the spec table: defaults, validation, the CRD's schema
    settings: type  # the typed spec the trainer reads (core/common_spec.py: from_spec)
    roles: tuple[Role, ...]  # in RPC rank order; the first is the master, rank 0
    # Module whose `run(env, checked)` runs every role of this kind in a pod, and whose
    # `export_checkpoint(directory, manifest, out, format)` is `pipejob export` of its checkpoints.
    trainer: str
    groups: tuple[ProcessGroup, ...] = ()
    columns: tuple[PrinterColumn, ...] = ()  # `kubectl get -o wide` columns of its own
    # Fill-ins that depend on other fields, after the table's defaults.
    complete: Callable[[RawSpec], RawSpec] = lambda spec: spec
    # What the table cannot say about a completed spec but would crash its world
    # (core/validate.py runs it with the checks every kind shares).
    check: Callable[[RawSpec], list[SpecError]] = lambda spec: []
    # The field that sizes the world and may be elastic, {min, max} (core/elastic.py): one
    # word, the spec's key, the settings' field and the status's. The roles and groups read it
    # as the number the world runs at.
    elastic: str | None = None
    # What `pipejob plan` says after the world, from the kind's settings (a HybridJob's tables
    # on its parameter servers).
    describe: Callable[[Any], list[str]] = lambda settings: []
    # Where its world's NCCL group members would have to share GPUs (the local runner, with
    # fewer GPUs than they ask): the spec to run instead and why, or None (a PipelineJob's
    # `engine: auto` runs on rpc, whose stages may share one).
    on_shared_gpus: Callable[[RawSpec], tuple[RawSpec, str] | None] = lambda spec: None
    # Whether its master checks what it can alone (a PipelineJob's model against the data and
    # the loss: its trainer module's `check(env)`, whose result `run` gets) before the world
    # forms, where it starts first (contract.MASTER_FIRST: the local runner starts the others
    # after it); a refusal there comes before any other member starts.
    checks_first: bool = False

    def role(self, name: str) -> Role:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"{self.name} has no role {name!r}")
