"""The JSON a PipelineJob run writes, as TypedDicts (the keys are the format, camelCase): the
run's summary (summary.py builds it, train.py completes it; the keys every kind has first
are runtime/roles.py's, an evaluation workloads/metrics.py's), the model's model.json
(trained_model.py) and `microBatches: auto`'s table (micro_batch_choice.py). No postponed
annotations here: each TypedDict's required and optional keys stay readable at run time
(`__required_keys__`), and tests/test_pipeline.py checks a run's summary against them."""

from typing import NotRequired, TypedDict

from pipejob.trainer.runtime.memory import Peak
from pipejob.trainer.runtime.model_files import ModelInfoBase
from pipejob.trainer.runtime.roles import SummaryBase
from pipejob.trainer.workloads.metrics import HeldOutEvaluation


class PipelineModelInfo(ModelInfoBase):
    """model.json's fields of the model (runtime/model_files.py adds the format and the
    files); a checkpoint's manifest keeps them as `info`; `pipejob export` adds the
    checkpoint it came from."""

    numClasses: int
    imageSize: int
    evaluation: HeldOutEvaluation | None
    checkpoint: NotRequired[str]


class Candidate(TypedDict):
    """One row of `microBatches: auto`'s table: timed, both bounds of the step in seconds;
    counted (spec.deterministic), the step's count."""

    microBatches: int
    microBatchSize: int
    predictedStepCount: NotRequired[float]
    pipelineBoundSeconds: NotRequired[float]
    coresBoundSeconds: NotRequired[float]
    predictedStepSeconds: NotRequired[float]
    predictedSamplesPerSecond: NotRequired[float]


class StageRow(TypedDict):
    """A stage process's row of the summary's partition, over the measured steps."""

    stage: str
    layers: list[str]  # the units it holds (the key predates the glossary's word)
    pieces: str
    costShare: float
    forwardSeconds: float
    backwardSeconds: float
    idleFraction: float
    peakMemory: Peak | None
    peakActivationBytes: NotRequired[int]  # where the engine counts them


class Bubble(TypedDict):
    """The measured bubble against GPipe's ideal and the schedule's."""

    measured: float
    gpipeIdeal: float
    scheduleIdeal: float


class BestEvaluation(TypedDict):
    """spec.eval.best's metric and the best evaluation's value and step (None: none yet)."""

    metric: str
    value: float | None
    step: int | None


class BestFigures(TypedDict, total=False):
    """The summary's spec.eval.best fields (none without it), and why the run stopped."""

    best: BestEvaluation
    stoppedEarly: str | None


class SetupFigures(TypedDict):
    """The summary's fields that say how the job was set up: model, engine, cut, batches."""

    model: str
    engine: str
    engineChosen: str | None
    schedule: str
    stages: int
    stagesPerProcess: int
    replicas: int
    cutBy: str
    microBatches: int
    microBatchesRequested: int | str
    microBatchCandidates: list[Candidate]
    batchSize: int
    imageSize: int


class CurveFigures(TypedDict):
    """Every step's loss, learning rate and gradient norm, and the first and last."""

    losses: list[float]
    firstLoss: float
    finalLoss: float
    learningRates: list[float | None]
    gradNorms: list[float | None]
    finalGradNorm: float | None


class RateFigures(TypedDict):
    """Samples a second and seconds a step, over the measured steps."""

    samplesPerSecond: float
    secondsPerStep: float
    allreduceSecondsPerStep: float
    optimizerSecondsPerStep: float


class PipelineSummary(SummaryBase, SetupFigures, CurveFigures, RateFigures, BestFigures):
    """A PipelineJob run's summary on the traced path (summary.json): its keys in the order
    summary.summarize writes them (the setup's, warm-up, the recipe's with the curves',
    the rates', the partition, memory and bubble), then those train.py adds after the
    steps (path, replica divergence, wall seconds, the evaluations, BestFigures')."""

    warmupStepsExcluded: int
    gradientAccumulation: int
    precision: str
    activationCheckpointing: bool
    clipGradNorm: float | None
    parameterGroups: dict[str, int]  # parameter elements by spec.optimizer group
    partition: list[StageRow]
    memory: dict[str, Peak]  # every member's peak, by member name
    bubble: Bubble
    path: NotRequired[str]
    replicaDivergence: NotRequired[float]
    wallSeconds: NotRequired[float]
    evaluation: NotRequired[HeldOutEvaluation]  # the last
    evaluations: NotRequired[list[HeldOutEvaluation]]
