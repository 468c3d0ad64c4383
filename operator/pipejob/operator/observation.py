"""What one reconcile sees of a job (`Observed`): its object and pods as read, the time, the
operator's settings, and the views every situation reads (the current world's pods, the pods
it should have, its master, the size it runs at). Pure: docs/architecture.md."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cached_property

from pipejob.core.contract import Progress
from pipejob.core.k8s import KubeObject
from pipejob.core.kinds.pipeline import PipelineSpec
from pipejob.core.spec import InvalidSpec, Job
from pipejob.operator import elastic_world, kube, oom_kills, parsed_specs
from pipejob.operator import status as st
from pipejob.operator.policy_settings import DEFAULT, NetworkPolicySettings
from pipejob.operator.status.job_status import JobStatus


def owned(pod: KubeObject, uid: str | None) -> bool:
    """Whether the object of `uid` (the job) is `pod`'s controller."""
    return any(
        ref.get("controller") and ref.get("uid") == uid
        for ref in pod["metadata"].get("ownerReferences") or []
    )


@dataclass(frozen=True)
class Observed:
    """The job object, every pod labelled with its name, and, when the caller polled it, the
    `progress` its current world's master reported. `allow_node_volumes` is the operator's
    allowance of hostPath and other node-level volumes; `policy` its settings of the worlds'
    NetworkPolicies (None: none)."""

    job_obj: KubeObject
    pods: list[KubeObject]
    now: datetime
    image: str
    progress: Progress | None = None
    allow_node_volumes: bool = False
    policy: NetworkPolicySettings | None = DEFAULT

    @property
    def meta(self) -> KubeObject:
        return self.job_obj["metadata"]

    @property
    def old(self) -> JobStatus:
        """The status as the last reconcile wrote it."""
        return self.job_obj.get("status") or {}

    @property
    def restart(self) -> int:
        """The current world's number: restarts + preemptions + resizes + oomKills."""
        return st.world_number(self.old)

    @property
    def namespace(self) -> str:
        return self.meta.get("namespace") or "default"

    @property
    def owner(self) -> KubeObject:
        return kube.owner_reference(self.job_obj)

    @cached_property
    def everything(self) -> list[KubeObject]:
        """The job's own pods, of every world, standby ones included."""
        return [p for p in self.pods if owned(p, self.meta.get("uid"))]

    @cached_property
    def standby(self) -> list[KubeObject]:
        """The standby pods: beside the world, not of it."""
        return [p for p in self.everything if elastic_world.is_standby(p)]

    @cached_property
    def ours(self) -> list[KubeObject]:
        """The job's pods of every world, standby ones left out."""
        return [p for p in self.everything if not elastic_world.is_standby(p)]

    @cached_property
    def current(self) -> list[KubeObject]:
        """The current world's pods."""
        return [p for p in self.ours if kube.restart_of(p) == self.restart]

    @cached_property
    def live(self) -> list[KubeObject]:
        """The job's pods not being deleted."""
        return [p for p in self.everything if not st.deleting(p)]

    @cached_property
    def parsed(self) -> Job | InvalidSpec:
        """The job as its spec says, or what is wrong with the spec (kept between
        reconciles while the spec is the same: parsed_specs.py)."""
        return parsed_specs.parsed(self.job_obj, self.allow_node_volumes)

    @cached_property
    def size(self) -> int | None:
        """The size the world runs at, elastic or fixed; None: the kind has no size."""
        return elastic_world.size(self.parsed, self.old) if isinstance(self.parsed, Job) else None

    @cached_property
    def job(self) -> Job:
        """The job at the size its world runs at (its spec valid: after situations.invalid)."""
        if isinstance(self.parsed, InvalidSpec):
            raise self.parsed
        # A world of raised memory is of another shape too: under Kueue, a new pod group.
        reshaped = int(self.old.get("resizes") or 0) + int(self.old.get("oomKills") or 0)
        if self.size is None and not reshaped:
            return self.parsed
        return self.parsed.sized(self.size, reshaped)

    @cached_property
    def planned(self) -> list[KubeObject]:
        """The current world's pods as they should be, in rank order (the master first), with
        the memory OOM kills raised (status.memory)."""
        pods = kube.world(self.job, self.restart, self.namespace, self.owner, self.image)
        return oom_kills.with_raised_memory(pods, self.old.get("memory"))

    @cached_property
    def by_name(self) -> dict[str, KubeObject]:
        """The current world's pods by name."""
        return {p["metadata"]["name"]: p for p in self.current}

    @property
    def master(self) -> KubeObject | None:
        """The current world's master pod, if it exists."""
        return self.by_name.get(self.planned[0]["metadata"]["name"])

    @cached_property
    def start(self) -> datetime:
        """When the job started (its deadline counts from it): now, the first time."""
        return st.parse_time(self.old.get("startTime")) or self.now

    def status(self) -> JobStatus:
        """A new status to start from: the old one with the current world's counts."""
        counts = st.role_counts(self.current, kube.role_of)
        new = dict(self.old, restarts=int(self.old.get("restarts") or 0), roles=counts)
        new["observedGeneration"] = (
            self.meta.get("generation") or self.old.get("observedGeneration") or 0
        )
        return new

    def sized_status(self) -> JobStatus:
        """`status()` with the size the world runs at (a valid spec's)."""
        new = self.status()
        if self.size is not None:
            new[self.job.definition.elastic] = self.size
        return self.with_engine(new)

    def active_status(self) -> JobStatus:
        """`sized_status()` of a job that is not suspended: with what the master reported, a
        failed preflight, and the job's start time."""
        new = self.sized_status()
        if self.progress is not None:
            new = st.with_report(new, self.progress, self.now)
        preflight = st.preflight_failure(self.current)
        if preflight is not None:
            new = st.with_preflight(new, False, preflight, self.now)
        new["startTime"] = st.timestamp(self.start)
        return self.with_engine(new)  # as the report says, if it does

    def with_engine(self, new: JobStatus) -> JobStatus:
        """`new` with the engine the world runs on (st.with_engine), a valid PipelineJob's;
        other kinds' status as it is."""
        if isinstance(self.parsed, Job) and isinstance(self.parsed.settings, PipelineSpec):
            return st.with_engine(new, self.parsed.settings.engine)
        return new
