"""A model built with only some of its parameters in memory (workloads/materialize.py): the
kept ones equal a plain build's wherever the cut falls, the rest take no memory, and the
random stream ends where a plain build leaves it."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from pipejob.core import spec
from pipejob.trainer.workloads import materialize, models

pytestmark = pytest.mark.timeout(120)


class Custom(nn.Module):
    """Initialisations torch.nn.init skips on meta tensors (orthogonal_, trunc_normal_), a
    parameter made by hand, a tie made by assignment and a parameter replaced after
    registration."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        nn.init.orthogonal_(self.a.weight)
        nn.init.trunc_normal_(self.b.weight, std=0.02)
        self.scale = nn.Parameter(torch.randn(8))
        self.out = nn.Linear(8, 8)
        self.out.weight = self.a.weight  # tied
        self.b.bias = nn.Parameter(torch.rand(8))  # replaces the registered one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b(self.a(x)) * self.scale)


def resnet() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def vit() -> nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, depth=2)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)  # its output embedding is tied to its input one


def resnet_double() -> nn.Module:
    return resnet().double()  # a conversion after the build: the parameters are new objects


def seeded(factory):
    def build():
        torch.manual_seed(7)
        return factory()

    return build


@pytest.mark.parametrize(
    "factory", [Custom, resnet, resnet_double, vit, gpt2], ids=lambda f: f.__name__
)
def test_kept_parameters_equal_a_plain_build_wherever_the_cut_falls(factory) -> None:
    build = seeded(factory)
    plain, registered = materialize.build(build, None)
    after_plain = torch.rand(4)  # where the random stream is after the build
    numbered = materialize.numbering(plain, registered)
    expected = plain.state_dict()
    count = len(numbered)
    for keep in [range(count // 3), range(count // 3, count), [0, count - 1], []]:
        part, registered_here = materialize.build(build, keep)
        assert torch.equal(torch.rand(4), after_plain)  # the stream advanced as in a plain build
        assert materialize.numbering(part, registered_here) == numbered
        kept = {name for i in keep for name in numbered[i]}
        state = part.state_dict()
        assert sorted(state) == sorted(expected)
        for name, value in part.named_parameters(remove_duplicate=False):
            if name in kept:
                assert value.device.type == "cpu" and torch.equal(value, expected[name]), name
            else:
                assert value.device.type == "meta", name
            assert value.dtype == expected[name].dtype, name
        for name, buffer in part.named_buffers():  # buffers are small: always built
            assert torch.equal(buffer, expected[name]), name


class InInit(nn.Module):
    """Values made in __init__, not reset_parameters: a parameter drawn before it is
    registered, one and a buffer computed from another parameter's value."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.v = nn.Parameter(torch.randn(4))
        self.u = nn.Parameter(self.w.detach() * 2)
        self.register_buffer("mean", self.w.detach().mean(0))


def lazy() -> nn.Module:
    model = nn.Sequential(nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 3, 6, 6))  # the dry run that makes their parameters
    return model


def parametrized() -> nn.Module:
    P = nn.utils.parametrizations
    return nn.Sequential(
        P.weight_norm(nn.Conv2d(3, 8, 3)),
        P.spectral_norm(nn.Linear(8, 8)),
        P.orthogonal(nn.Linear(8, 8)),
        nn.utils.spectral_norm(nn.Linear(8, 8)),
    )


CONSTRUCTS = {  # torch.nn's modules whose building reads values of parameters it made
    "transformer-encoder": lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 3, enable_nested_tensor=False
    ),
    "transformer": lambda: nn.Transformer(16, 2, 2, 2, 32),
    "recurrent": lambda: nn.Sequential(
        nn.LSTM(8, 16, 2, proj_size=4), nn.GRU(8, 8), nn.RNN(4, 4), nn.MultiheadAttention(8, 2)
    ),
    "parametrizations": parametrized,
    "lazy": lazy,
    "in-init": InInit,
}


@pytest.mark.parametrize("name", list(CONSTRUCTS))
def test_whatever_a_stage_keeps_equals_a_plain_build(name: str) -> None:
    """Deep copies of a layer, parametrizations computed from the weight they replace,
    lazy parameters and values made in __init__: the parameters and buffers a process
    keeps (with what `numbers` adds for them to be computed from) equal a plain build's,
    bit for bit, and the random stream ends where a plain build leaves it (issue 30)."""
    build = seeded(CONSTRUCTS[name])
    plain, _ = materialize.build(build, None)
    after_plain = torch.rand(4)
    numbered = materialize.numbering(*materialize.build(build, ()))
    expected = {
        **dict(plain.named_parameters(remove_duplicate=False)),
        **dict(plain.named_buffers()),
    }
    names = sorted(expected)
    thirds = [names[k * len(names) // 3 : (k + 1) * len(names) // 3] for k in range(3)]
    for wanted in [*thirds, names[::2]]:
        part, _ = materialize.build(build, materialize.numbers(numbered, wanted))
        assert torch.equal(torch.rand(4), after_plain)
        got = {**dict(part.named_parameters(remove_duplicate=False)), **dict(part.named_buffers())}
        for key in wanted:
            assert got[key].device.type != "meta" and torch.equal(got[key], expected[key]), key


def test_ties_share_one_number_and_replaced_parameters_have_no_name() -> None:
    plain, registered = materialize.build(seeded(Custom), None)
    numbered = materialize.numbering(plain, registered)
    assert ["a.weight", "out.weight"] in numbered  # one tensor, held under both names
    assert [] in numbered  # b.bias's first parameter, replaced by the factory
    tied = materialize.numbers(numbered, ["out.weight"])
    assert tied == materialize.numbers(numbered, ["a.weight"])
    part, _ = materialize.build(seeded(Custom), tied)
    assert part.out.weight is part.a.weight and part.a.weight.device.type == "cpu"


def test_another_thread_never_sees_a_build() -> None:
    """While one thread builds a model keeping none of its parameters, a module another
    thread makes at the same time is torch's own: real parameters, none numbered."""
    started, other_made = threading.Event(), threading.Event()
    made: list[nn.Module] = []

    def other() -> None:
        assert started.wait(30)
        made.append(nn.Linear(3, 3))
        other_made.set()

    def factory() -> nn.Module:
        started.set()
        assert other_made.wait(30)
        return nn.Linear(4, 4)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    model, registered = materialize.build(factory, [])
    thread.join(30)
    assert model.weight.device.type == "meta" and len(registered.params) == 2
    assert made and all(p.device.type == "cpu" for p in made[0].parameters())
    assert nn.Module.register_parameter is materialize._REGISTER  # torch's own again


def test_the_jobs_model_on_the_meta_device_holds_no_parameter_memory() -> None:
    model_spec = {
        "transformer": {"vocabSize": 256, "layers": 4, "width": 128, "heads": 4, "seqLen": 16}
    }
    manifest = {
        "apiVersion": spec.API_VERSION,
        "kind": "PipelineJob",
        "metadata": {"name": "m"},
        "spec": {"model": model_spec, "stages": 2},
    }
    job = spec.parse(manifest)
    model, numbered = models.build_meta(job.settings)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(len(names) > 0 for names in numbered) == len(list(model.parameters()))
    plain = models.build(job.settings)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_building_leaves_torchs_compiler_unloaded() -> None:
    """A build's dispatch mode does not load torch._dynamo and inductor into the process, as
    torch's default wrapping of a mode would: 100 MB of every stage's memory."""
    import subprocess
    import sys

    program = (
        "import sys, torch\n"
        "from pipejob.trainer.workloads import materialize\n"
        "model, _ = materialize.build(lambda: torch.nn.Linear(4, 4), (0,))\n"
        "assert model.weight.device.type == 'cpu' and model.bias.device.type == 'meta'\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=90, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
