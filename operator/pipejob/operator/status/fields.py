"""The job's status as a table of fields: the CRD's status schema and its API reference."""

from __future__ import annotations

from pipejob.core.schema import Field
from pipejob.operator.status.conditions import CONDITIONS, PHASES

_COUNT = Field("integer", "Pods in this state.", minimum=0)

STATUS = Field(
    "object",
    "What the operator observed: the job's phase, its pods per role, restarts and history.",
    fields={
        "phase": Field(
            "string",
            "Pending, Queued, Running, Restarting, Suspended, Succeeded or Failed.",
            enum=PHASES,
        ),
        "observedGeneration": Field(
            "integer", "The metadata.generation of the spec this status describes.", minimum=0
        ),
        "restarts": Field(
            "integer",
            "Whole-world restarts after failures so far (each spends backoffLimit).",
            minimum=0,
        ),
        "preemptions": Field(
            "integer",
            "Whole-world restarts after a pod was preempted, evicted or disrupted (its"
            " DisruptionTarget condition); they spend no backoffLimit. Pods carry"
            " restarts + preemptions + resizes + oomKills, the world's number, as the"
            " pipejob.dev/restart label.",
            minimum=0,
        ),
        "startTime": Field("string", "When the operator started the job (RFC 3339)."),
        "completionTime": Field("string", "When the job succeeded or failed (RFC 3339)."),
        "resizes": Field(
            "integer",
            "Whole-world restarts at another size (an elastic replicas or trainers); they"
            " spend no backoffLimit and count in the world's number.",
            minimum=0,
        ),
        "oomKills": Field(
            "integer",
            "Whole-world restarts after a member was killed for memory (OOMKilled), each with"
            " that role's memory raised (spec.oom); they spend no backoffLimit and count in"
            " the world's number.",
            minimum=0,
        ),
        "memory": Field(
            "object",
            "The memory limit (or request, where the template sets no limit) each role's pods"
            " were raised to after OOM kills (spec.oom), by role (master, stage, ps, trainer).",
            values=Field("string", "A Kubernetes quantity, e.g. 6Gi."),
        ),
        "replicas": Field(
            "integer", "PipelineJob: copies of the pipeline the current world runs.", minimum=0
        ),
        "trainers": Field("integer", "HybridJob: trainers the current world runs.", minimum=0),
        "engine": Field(
            "string",
            "PipelineJob: the engine the current world runs on, as its master reported it"
            " (the one spec.engine auto chose), else spec.engine as written (auto until the"
            " master has chosen).",
        ),
        "roles": Field(
            "object",
            "Pods of the current world per role (master, stage, ps, trainer), by pod phase.",
            values=Field(
                "object",
                "Pod counts of one role.",
                fields={
                    "pending": _COUNT,
                    "running": _COUNT,
                    "succeeded": _COUNT,
                    "failed": _COUNT,
                },
            ),
        ),
        "conditions": Field(
            "array",
            "Created, Queued, Running, Restarting, Suspended, Succeeded, Failed, Preflight"
            " and Resized, each with why.",
            items=Field(
                "object",
                "One condition of the job.",
                fields={
                    "type": Field("string", "The condition.", enum=CONDITIONS),
                    "status": Field(
                        "string", "Whether it holds.", enum=("True", "False", "Unknown")
                    ),
                    "reason": Field("string", "One CamelCase word saying why."),
                    "message": Field("string", "A sentence saying why."),
                    "lastTransitionTime": Field("string", "When status last changed (RFC 3339)."),
                },
                required=("type", "status"),
            ),
        ),
        "progress": Field(
            "string", "Training progress reported by the master, as step/steps (e.g. 7/10)."
        ),
        "training": Field(
            "object",
            "Live training figures, polled from the master's /progress while the job runs.",
            free_form=True,
            fields={
                "phase": Field(
                    "string",
                    "What the master is doing: starting, preflight, training, finished or failed.",
                ),
                "step": Field("integer", "Last finished step.", minimum=0),
                "steps": Field("integer", "Steps the job runs in total.", minimum=0),
                "loss": Field("number", "Loss of the last finished step."),
                "samplesPerSecond": Field("number", "Training throughput."),
                "bubble": Field(
                    "number",
                    "PipelineJob: measured share of time the stages sat idle.",
                ),
                "learningRate": Field(
                    "number", "Learning rate of the last optimizer step (optimizer.schedule)."
                ),
                "gradNorm": Field(
                    "number",
                    "Global L2 norm of the last step's gradients over every stage and replica,"
                    " before clipping (optimizer.clipGradNorm).",
                ),
                "resumedFromStep": Field(
                    "integer", "The checkpoint step the current world resumed from.", minimum=0
                ),
                "checkpointStep": Field(
                    "integer",
                    "The step of the newest checkpoint the current world wrote.",
                    minimum=0,
                ),
                "checkpointTime": Field("string", "When it was written (RFC 3339)."),
                "message": Field("string", "The master's last word on its state."),
                "engine": Field(
                    "string",
                    "PipelineJob: the engine the master runs the job on (rpc or pipelining),"
                    " once it has chosen.",
                ),
                "evalStep": Field(
                    "integer",
                    "The step of the last evaluation on held-out data (spec.eval).",
                    minimum=0,
                ),
                "evalLoss": Field("number", "Loss on the held-out data at the last evaluation."),
                "evalAccuracy": Field(
                    "number", "Held-out accuracy (0 to 1) at the last evaluation (classification)."
                ),
                "evalPerplexity": Field(
                    "number",
                    "Perplexity (exp of the per-token loss) on the held-out tokens at the last"
                    " evaluation (the language model).",
                ),
                "evalAuc": Field(
                    "number",
                    "Area under the ROC curve on the held-out samples at the last evaluation"
                    " (a HybridJob's clicks; its evalLoss is their log loss).",
                ),
                "memory": Field(
                    "object",
                    "Peak memory of each member of the world so far (by RPC name: master,"
                    " stage0, ps0, trainer1, ...), measured at each logged step and at the end,"
                    " so the tight one shows.",
                    values=Field(
                        "object",
                        "One member's peaks, in bytes.",
                        fields={
                            "rssPeakBytes": Field(
                                "integer",
                                "Peak resident memory (VmHWM), what a memory limit counts.",
                                minimum=0,
                            ),
                            "cudaPeakBytes": Field(
                                "integer",
                                "Peak GPU memory torch allocated (a member on a GPU).",
                                minimum=0,
                            ),
                        },
                    ),
                ),
                "updateTime": Field("string", "When these figures last changed (RFC 3339)."),
            },
        ),
    },
)
