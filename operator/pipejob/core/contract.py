"""The env contract between the world plan and the trainer: every variable, in one place.

Standard torch names where they exist (the RPC world); the rest is prefixed PIPEJOB_."""

MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"

KIND = "PIPEJOB_KIND"
JOB = "PIPEJOB_JOB"
ROLE = "PIPEJOB_ROLE"
ROLE_INDEX = "PIPEJOB_ROLE_INDEX"
RPC_NAME = "PIPEJOB_RPC_NAME"
WORLD = "PIPEJOB_WORLD"
ADDRESSES = "PIPEJOB_ADDRESSES"
PREFLIGHT_PORT = "PIPEJOB_PREFLIGHT_PORT"
MONITOR_PORT = "PIPEJOB_MONITOR_PORT"
SPEC = "PIPEJOB_SPEC"
GPUS = "PIPEJOB_GPUS"
RENDEZVOUS_TIMEOUT = "PIPEJOB_RENDEZVOUS_TIMEOUT"

DDP_ADDR = "PIPEJOB_DDP_ADDR"
DDP_PORT = "PIPEJOB_DDP_PORT"
DDP_RANK = "PIPEJOB_DDP_RANK"
DDP_WORLD_SIZE = "PIPEJOB_DDP_WORLD_SIZE"
DDP_BACKEND = "PIPEJOB_DDP_BACKEND"

# Optional, set by whoever runs the world rather than by the plan.
SUMMARY_FILE = "PIPEJOB_SUMMARY_FILE"
TERMINATION_LOG = "PIPEJOB_TERMINATION_LOG"
TUNING = "PIPEJOB_TUNING"

DOCS: dict[str, str] = {
    MASTER_ADDR: "Address of the master: the RPC rendezvous (TCP store) host.",
    MASTER_PORT: "Port of the RPC rendezvous on the master.",
    RANK: "This process's rank in the RPC world (master is 0).",
    WORLD_SIZE: "Processes in the RPC world.",
    KIND: "PipelineJob or HybridJob.",
    JOB: "Name of the job.",
    ROLE: "master, stage, ps or trainer.",
    ROLE_INDEX: "Index of this process within its role (stage i, trainer k).",
    RPC_NAME: "This process's RPC worker name (master, stage0, ps, trainer1, ...).",
    WORLD: "Comma-separated RPC names of the whole world, in rank order.",
    ADDRESSES: "Comma-separated addresses of the whole world, in rank order (for messages).",
    PREFLIGHT_PORT: "Port of the whole world's gloo group for the preflight check (master).",
    MONITOR_PORT: "Port of the master's HTTP endpoint: /progress (JSON) and /metrics.",
    SPEC: "The job's validated, defaulted spec as JSON.",
    GPUS: "GPUs this process may use; 0 means CPU (and gloo).",
    RENDEZVOUS_TIMEOUT: "Seconds to wait for the RPC world and DDP group to form.",
    DDP_ADDR: "HybridJob trainers: address of the DDP rendezvous (trainer 0).",
    DDP_PORT: "HybridJob trainers: port of the DDP rendezvous, never the RPC one.",
    DDP_RANK: "HybridJob trainers: rank in the DDP process group.",
    DDP_WORLD_SIZE: "HybridJob trainers: size of the DDP process group.",
    DDP_BACKEND: "HybridJob trainers: gloo or nccl.",
    SUMMARY_FILE: "Optional: the master writes its end-of-run summary here as JSON.",
    TERMINATION_LOG: "Optional: where a failing process writes its one-line reason"
    " (default /dev/termination-log, Kubernetes' termination message).",
    TUNING: "Optional: performance levers (threads, allocator, transport): unset or on for"
    " all, off for none, or a comma-separated list. Variables the user sets always win.",
}
