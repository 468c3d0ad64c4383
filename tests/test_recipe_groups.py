"""spec.optimizer's parameter groups (issue 58): weight decay and learning rate per group,
the noDecay preset, layer-wise decay, Adam's betas.

The acceptance test runs nanoGPT's recipe (its configure_optimizers: parameters of 2 or more
dimensions decay, the rest do not; AdamW with betas (0.9, 0.95); warmup then cosine; gradient
clipping) as a manifest in a real world (the trainer's own stage role in spawned processes,
the master driving the trainer's ReplicasBase), on a float64 model with a tied embedding (as
nanoGPT ties wte and lm_head), and compares the losses and weights of steps 1..3 with
nanoGPT's own configure_optimizers in one process. float64: as in tests/test_recipes.py, the
pipeline sums the same gradients in another order, which stays near 1e-16; a parameter in the
wrong group (decayed when it should not be, or at the wrong rate) moves it by 1e-4 or more."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

from jobrun import master_of, pipeline_job, run_world
from pipejob.core import plan, spec
from pipejob.core.optimizer import Optimizer
from pipejob.runner.local import LOOPBACK, free_ports
from pipejob.trainer import workloads
from pipejob.trainer.pipeline import replicas_class, summary
from pipejob.trainer.pipeline.cut_model import CutModel, Partition
from pipejob.trainer.pipeline.stage_base import StageBase
from pipejob.trainer.runtime import param_groups
from pipejob.trainer.runtime.optim import Functional, build, learning_rate, set_lr
from pipejob.trainer.workloads import cut

STEPS, BATCH, VOCAB, WIDTH = 3, 8, 16, 8
LR, WEIGHT_DECAY, CLIP = 0.05, 0.1, 0.5
# nanoGPT's recipe, as a manifest.
NANOGPT = {
    "name": "adamw",
    "lr": LR,
    "beta1": 0.9,
    "beta2": 0.95,
    "weightDecay": WEIGHT_DECAY,
    "clipGradNorm": CLIP,
    "schedule": {"warmupSteps": 2, "decay": "cosine", "minLr": LR / 10},
    "groups": [{"name": "no-decay", "preset": "noDecay"}],
}
LAYERS = ["wte", "ln_1", "fc", "act", "ln_f", "lm_head"]
CUTS = {2: ["fc"], 3: ["fc", "ln_f"]}


def gpt() -> nn.Sequential:
    """nanoGPT's parameter kinds in small: a token embedding tied to the head (lm_head has
    no bias and shares wte's weight), LayerNorms (1-D weights and biases), a Linear."""
    torch.manual_seed(5)
    model = nn.Sequential(
        OrderedDict(
            [
                ("wte", nn.Embedding(VOCAB, WIDTH)),
                ("ln_1", nn.LayerNorm(WIDTH)),
                ("fc", nn.Linear(WIDTH, WIDTH)),
                ("act", nn.GELU()),
                ("ln_f", nn.LayerNorm(WIDTH)),
                ("lm_head", nn.Linear(WIDTH, VOCAB, bias=False)),
            ]
        )
    ).double()
    with torch.no_grad():  # LayerNorms not at their identity start: their decay would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.lm_head.weight = model.wte.weight
    return model


def configure_optimizers(model: nn.Module) -> torch.optim.AdamW:
    """nanoGPT's GPT.configure_optimizers (model.py), as it is, on CPU (not fused)."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [
        {"params": decay_params, "weight_decay": WEIGHT_DECAY},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(optim_groups, lr=LR, betas=(0.9, 0.95))


IGNORED = 3  # the smoothed case's ignoreIndex: one label of each micro-batch of 4


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        x, y = (torch.randint(VOCAB, (BATCH,), generator=g) for _ in range(2))
        # Each micro-batch's mean counts as many labels: one ignored in each (a pipeline
        # weighs its micro-batches' means by their samples; user-guide, spec.loss).
        y[y == IGNORED] = IGNORED + 1
        y[0] = y[BATCH // 2] = IGNORED
        out.append((x, y))
    return out


def _nanogpt_world(rank: int, envs: list[dict[str, str]], out: str) -> None:
    if (env := master_of(rank, envs)) is None:
        return
    try:
        s = env.spec
        traced = cut.Traced(gpt())
        starts = [0, *(LAYERS.index(c) for c in CUTS[s.stages]), len(LAYERS)]
        ranges = [range(a, b) for a, b in zip(starts, starts[1:], strict=False)]
        stages = traced.split(CUTS[s.stages])
        cut_model = CutModel(
            traced.units,
            stages,
            Partition(ranges, [1.0] * len(LAYERS), 2),
            {},
            tied=cut.ties(stages),
        )
        replicas = replicas_class(s)([env.names("stage")], cut_model, s)
        loss = workloads.loss(s)  # the built-in cross-entropy, with spec.loss's options
        results = [replicas.step(2, step, loss, batch) for step, batch in enumerate(batches())]
        pipe = replicas.pipelines[0]
        state = {k: v for part in pipe.stage_results(StageBase.state) for k, v in part.items()}
        torch.save({"results": [(r.loss, r.lr, r.grad_norm) for r in results], "state": state}, out)
    finally:
        rpc.shutdown()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("stages", "engine_fields"),
    # The tied 3-stage pipelining world holds the others: the same groups on every stage.
    [
        pytest.param(2, {"engine": "rpc"}, marks=pytest.mark.slow),
        pytest.param(3, {"engine": "rpc"}, marks=pytest.mark.slow),
        pytest.param(2, {"engine": "pipelining", "schedule": "1f1b"}, marks=pytest.mark.slow),
        (3, {"engine": "pipelining", "schedule": "gpipe"}),
        # spec.loss.crossEntropy's options reach the last stage (the loss crosses RPC)
        (
            2,
            {
                "engine": "rpc",
                "loss": {"crossEntropy": {"labelSmoothing": 0.1, "ignoreIndex": IGNORED}},
            },
        ),
    ],
    ids=[
        "rpc-2-stages",
        "rpc-3-stages-tied",
        "pipelining-2-stages",
        "pipelining-3-stages-tied",
        "rpc-2-stages-label-smoothing-ignore-index",
    ],
)
def test_nanogpts_recipe_equals_its_configure_optimizers(
    tmp_path: Path, stages: int, engine_fields: dict[str, Any]
) -> None:
    job = spec.parse(
        pipeline_job(
            "nanogpt",
            stages=stages,
            microBatches=2,
            steps=STEPS,
            optimizer=NANOGPT,
            **engine_fields,
        )
    )
    options = engine_fields.get("loss", {}).get("crossEntropy", {})
    smoothing, ignored = options.get("labelSmoothing", 0.0), options.get("ignoreIndex", -100)
    ports = free_ports(4 + stages)
    processes = plan.plan_world(
        job, lambda m: LOOPBACK, plan.Ports(*ports[:4], groups=tuple(ports[4:]))
    )
    got = run_world(_nanogpt_world, [p.env for p in processes], tmp_path / "nanogpt.pt")

    # nanoGPT's train.py: the lr of the iteration, clip_grad_norm_, step, zero_grad.
    model = gpt()
    optimizer = configure_optimizers(model)
    settings = job.settings.optimizer
    expected = []
    for step, (x, y) in enumerate(batches()):
        lr = learning_rate(settings, STEPS, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = F.cross_entropy(model(x), y, label_smoothing=smoothing, ignore_index=ignored)
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
        assert norm > CLIP, "the test must clip"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        expected.append((loss.item(), lr, norm))
    assert expected[2][1] == pytest.approx(LR / 10 + (LR - LR / 10) * 0.5 * (1 + math.cos(0)))

    for (loss, lr, norm), (want_loss, want_lr, want_norm) in zip(
        got["results"], expected, strict=True
    ):
        assert loss == pytest.approx(want_loss, rel=1e-9)
        assert lr == pytest.approx(want_lr, rel=1e-12)
        assert norm == pytest.approx(want_norm, rel=1e-9)
    want = model.state_dict()
    assert sorted(got["state"]) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-9, atol=1e-12, msg=name)


# ------------------------------------------------------ groups in one process, refusals


def settings(**fields: Any) -> Optimizer:
    """spec.optimizer as the trainer reads it: parsed (defaults filled) from `fields`."""
    return spec.parse(pipeline_job("groups", optimizer=fields)).settings.optimizer


VIT = [  # timm's ViT names and shapes (2 blocks)
    ("cls_token", (1, 1, 8)),
    ("pos_embed", (1, 5, 8)),
    ("patch_embed.proj.weight", (8, 3, 4, 4)),
    ("patch_embed.proj.bias", (8,)),
    ("blocks.0.norm1.weight", (8,)),
    ("blocks.0.attn.qkv.weight", (24, 8)),
    ("blocks.1.mlp.fc1.weight", (16, 8)),
    ("blocks.1.mlp.fc1.bias", (16,)),
    ("norm.weight", (8,)),
    ("head.weight", (10, 8)),
    ("head.bias", (10,)),
]

STEM = ["cls_token", "pos_embed", "patch_embed.*"]


def test_each_parameter_goes_to_its_first_matching_group_with_its_depths_rate():
    opt = settings(
        name="adamw",
        lr=1.0,
        weightDecay=0.05,
        groups=[
            {"name": "head", "params": ["head.*"], "lrScale": 10, "weightDecay": 0.01},
            {"name": "no-decay", "preset": "noDecay"},
            {"name": "tokens", "params": ["cls_token", "pos_*"], "maxDims": 3},
        ],
        layerDecay={"rate": 0.5, "layers": 2, "blocks": "blocks", "stem": ["patch_embed.*"]},
    )
    placed = {
        n: (p.group, p.weight_decay, p.lr_scale)
        for n, shape in VIT
        for p in [param_groups.place(opt, n, len(shape))]
    }
    # The stem: rate ** (layers + 1); block i: rate ** (layers - i); the rest: 1 (timm's).
    assert placed == {
        "cls_token": ("tokens", 0.05, 1.0),
        "pos_embed": ("tokens", 0.05, 1.0),
        "patch_embed.proj.weight": ("default", 0.05, 0.125),
        "patch_embed.proj.bias": ("no-decay", 0.0, 0.125),
        "blocks.0.norm1.weight": ("no-decay", 0.0, 0.25),
        "blocks.0.attn.qkv.weight": ("default", 0.05, 0.25),
        "blocks.1.mlp.fc1.weight": ("default", 0.05, 0.5),
        "blocks.1.mlp.fc1.bias": ("no-decay", 0.0, 0.5),
        "norm.weight": ("no-decay", 0.0, 1.0),
        "head.weight": ("head", 0.01, 10.0),
        "head.bias": ("head", 0.01, 10.0),  # the first group that matches wins
    }
    named = [(n, torch.zeros(shape)) for n, shape in VIT]
    assert param_groups.counts(opt, named) == {
        "tokens": 48,
        "default": 8 * 48 + 24 * 8 + 16 * 8,
        "no-decay": 8 + 8 + 16 + 8,
        "head": 90,
    }


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "rmsprop"])
def test_a_stages_groups_step_as_torch_optim_with_the_same_groups(name: str) -> None:
    """Functional (a stage's) and build (a HybridJob trainer's) against torch.optim given the
    groups by hand, through a schedule's learning rate (set_lr keeps each group's scale)."""
    fields: dict[str, Any] = {"name": name, "lr": 0.1, "weightDecay": 0.1}
    fields |= {"beta1": 0.8, "beta2": 0.9} if name.startswith("adam") else {"momentum": 0.9}
    opt = settings(
        **fields,
        groups=[{"name": "no-decay", "maxDims": 1, "weightDecay": 0.0, "lrScale": 3}],
        layerDecay={"rate": 0.5, "layers": 2, "blocks": "blocks", "stem": STEM},
    )
    torch.manual_seed(0)
    named = [(n, torch.randn(shape, dtype=torch.float64)) for n, shape in VIT]
    copies = [[(n, p.clone().requires_grad_()) for n, p in named] for _ in range(3)]
    ours, hybrid, theirs = ([p for _, p in c] for c in copies)
    by_hand = [  # [scale, weight decay]: VIT's parameters in order
        (0.125, 0.1),
        (0.125, 0.1),
        (0.125, 0.1),
        (0.375, 0.0),
        (0.75, 0.0),
        (0.25, 0.1),
        (0.5, 0.1),
        (1.5, 0.0),
        (3.0, 0.0),
        (1.0, 0.1),
        (3.0, 0.0),
    ]
    kwargs = {k: v for k, v in fields.items() if k in ("momentum",)}
    if name.startswith("adam"):
        kwargs["betas"] = (0.8, 0.9)
    groups = [
        {"params": [p], "lr": 0.1 * s, "weight_decay": d, "lr_scale": s}
        for p, (s, d) in zip(theirs, by_hand, strict=True)
    ]
    reference = torch.optim.__dict__[type(build(opt, copies[2])).__name__](groups, **kwargs)
    functional = Functional(opt, copies[0])
    built = build(opt, copies[1])
    for step in range(3):
        grads = [torch.randn_like(p) for p in ours]
        for params in (hybrid, theirs):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
        functional.step(dict(zip(ours, grads, strict=True)))
        built.step()
        reference.step()
        for o in (functional, built, reference):
            set_lr(o, learning_rate(opt, 3, step) * 0.5)
    for a, b, c in zip(ours, hybrid, theirs, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)


def refusals(**fields: Any) -> list[str]:
    with pytest.raises(spec.InvalidSpec) as refused:
        spec.parse(pipeline_job("bad", optimizer=fields))
    return [str(e) for e in refused.value.errors]


def test_bad_groups_are_refused_naming_the_field():
    g = "spec.optimizer.groups[0]"
    assert refusals(groups=[{"name": "a"}]) == [
        f"{g}: a group needs a preset, params or maxDims to say which parameters it holds"
    ]
    assert refusals(groups=[{"name": "a", "preset": "noDecay", "params": ["x"]}]) == [
        f"{g}.preset: a preset says which parameters the group holds: leave params and maxDims out"
    ]
    assert refusals(groups=[{"maxDims": 1}]) == [f"{g}.name: is required"]
    (preset,) = refusals(groups=[{"name": "a", "preset": "nodecay"}])
    assert preset.startswith(f"{g}.preset: must be one of noDecay")
    (scale,) = refusals(groups=[{"name": "a", "maxDims": 1, "lrScale": 0}])
    assert scale.startswith(f"{g}.lrScale: must be > 0")
    (decay,) = refusals(groups=[{"name": "a", "maxDims": 1, "weightDecay": -1}])
    assert decay.startswith(f"{g}.weightDecay: must be >= 0")
    (empty,) = refusals(groups=[{"name": "a", "params": [" "]}])
    assert empty.startswith(f"{g}.params[0]: ")
    (twice,) = refusals(groups=[{"name": "a", "maxDims": 1}, {"name": "a", "maxDims": 2}])
    assert twice.startswith("spec.optimizer.groups[1]") and "'a'" in twice
    assert refusals(name="sgd", beta2=0.95) == [
        "spec.optimizer.beta1: only adam and adamw have betas: leave beta1 and beta2 out"
    ]
    (beta,) = refusals(name="adamw", beta1=1.0)
    assert beta.startswith("spec.optimizer.beta1: must be < 1")
    (layers,) = refusals(layerDecay={"rate": 0.7, "blocks": "blocks"})
    assert layers == "spec.optimizer.layerDecay.layers: is required"
    (rate,) = refusals(layerDecay={"rate": 1.5, "layers": 2, "blocks": "blocks"})
    assert rate.startswith("spec.optimizer.layerDecay.rate: must be <= 1")
    (blocks,) = refusals(layerDecay={"rate": 0.5, "layers": 2, "blocks": "blocks.*"})
    assert blocks.startswith("spec.optimizer.layerDecay.blocks: must be a module name")


def test_the_summary_counts_each_groups_parameters_a_tied_one_once():
    stages = cut.Traced(gpt()).split(CUTS[3])
    ranges = [range(0, 2), range(2, 4), range(4, 6)]
    cut_model = CutModel(LAYERS, stages, Partition(ranges, [1.0] * 6, 2), {}, tied=cut.ties(stages))
    job = spec.parse(pipeline_job("groups", stages=3, optimizer=NANOGPT)).settings
    # wte's weight (tied to lm_head's) and fc's weight; the LayerNorms' and fc's bias
    assert summary.group_counts(job, cut_model) == {
        "default": VOCAB * WIDTH + WIDTH * WIDTH,
        "no-decay": 4 * WIDTH + WIDTH,
    }


def test_groups_that_split_a_tied_weight_are_refused_before_the_cut():
    """One process steps wte.weight (lm_head's too) once, in wte's group: the stages holding
    its two copies must place both alike."""
    named = list(gpt().named_parameters(remove_duplicate=False))
    param_groups.check_ties(settings(**NANOGPT), named)  # nanoGPT's: both 2-D, both decay
    head = settings(name="adamw", groups=[{"name": "head", "params": ["lm_head.*"], "lrScale": 2}])
    with pytest.raises(ValueError) as refused:
        param_groups.check_ties(head, named)
    assert str(refused.value) == (
        "spec.optimizer.groups: wte.weight and lm_head.weight are one tied parameter, but the"
        " groups (or layerDecay) place them apart (default, head): match both names alike"
    )
