"""Any model cut into stages at module names (trainer/workloads/cut.py): the stages compose
to the model's forward, keep its parameter names, carry several values across a cut, and
refuse what cannot work, saying why."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torchvision.models import get_model
from torchvision.models.inception import InceptionOutputs
from transformers import PretrainedConfig
from transformers.masking_utils import create_bidirectional_mask

from pipejob.core.workload import Transformer
from pipejob.trainer.workloads.cut import CutError, Traced, candidates, ties, unused
from pipejob.trainer.workloads.transformer import TransformerLM

pytestmark = pytest.mark.timeout(120)


def run(stages: list[nn.Module], *inputs: torch.Tensor):
    values = inputs
    for stage in stages:
        values = stage(*values)
    return values


# One of each family (tests/test_models.py counts every model's cut candidates on the meta
# device): the forwards between their modules differ (flatten, pooling, classifier).
FAMILIES = [
    "resnet18",
    "resnext50_32x4d",
    "vgg11_bn",
    "alexnet",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "convnext_tiny",
]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_torchvision_family_cut_in_three_computes_what_it_computes(name):
    torch.manual_seed(0)
    model = get_model(name, weights=None, num_classes=10).eval()
    traced = Traced(model)
    n = len(traced.units)
    stages = traced.split([traced.units[n // 3], traced.units[2 * n // 3]])
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(run(stages, x), model(x), rtol=0, atol=0)
    # The stages hold every parameter and buffer once, under the model's own names.
    names = [k for stage in stages for k in stage.state_dict()]
    assert sorted(names) == sorted(model.state_dict())


def test_resnet_candidates_are_todays_layers_without_the_functional_flatten():
    """The cut ResNets had before (stem, residual blocks, head), now found in the module
    tree: torch.flatten is an operation of the forward, not a module."""
    model = get_model("resnet50", weights=None)
    blocks = [f"layer{i}.{j}" for i, n in ((1, 3), (2, 4), (3, 6), (4, 3)) for j in range(n)]
    expected = ["conv1", "bn1", "relu", "maxpool", *blocks, "avgpool", "fc"]
    assert candidates(model) == expected
    assert Traced(model).units == expected


class Skip(nn.Module):
    """A U-shaped model: the encoder's output skips the middle and joins at the end, and the
    forward carries a size across cuts, so stages must pass several values on."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(4, 8)
        self.middle = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.decode = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.encode(x)
        m = self.middle(e)
        return self.decode(torch.cat([e, m], dim=1)).reshape(x.shape[0], -1)


def test_values_live_across_a_cut_are_passed_on_and_gradients_flow():
    torch.manual_seed(0)
    model = Skip()
    traced = Traced(model)
    assert traced.units == ["encode", "middle.0", "middle.1", "middle.2", "decode"]
    stages = traced.split(["middle.0", "decode"])
    x = torch.randn(5, 4)
    first = stages[0](x)
    assert isinstance(first, tuple) and len(first) == 2  # x (for its shape) and e
    assert sum(isinstance(v, torch.Tensor) and v.shape == (5, 8) for v in first) == 1
    out = run(stages, x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).sum().backward()
    for n, p in model.named_parameters():  # the stages are views of the model's modules
        torch.testing.assert_close(grads[n], p.grad * 1, msg=n)


def test_transformer_stages_keep_names_and_pickle():
    torch.manual_seed(0)
    spec = Transformer(vocab_size=50, layers=3, width=16, heads=2, seq_len=12)
    model = TransformerLM(spec).eval()
    traced = Traced(model)
    assert traced.units == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    stages = traced.split(["blocks.1", "norm"])
    assert list(stages[1].state_dict())[0] == "blocks.1.norm1.weight"
    stages = [pickle.loads(pickle.dumps(s)) for s in stages]  # as the master ships them
    ids = torch.randint(50, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(run(stages, ids), model(ids), rtol=0, atol=0)


def test_split_points_must_be_candidates_in_order():
    traced = Traced(get_model("resnet18", weights=None))
    with pytest.raises(
        CutError,
        match=r"layer3 is not where a stage can begin; the candidates,"
        r" in order: conv1, bn1, .*layer3\.0",
    ):
        traced.split(["layer3"])
    with pytest.raises(CutError, match="must be distinct candidates in the order"):
        traced.split(["layer3.0", "layer2.0"])
    with pytest.raises(CutError, match="after its first"):
        traced.split(["conv1"])


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.mix(self.embed(ids)))


def test_tied_weights_across_stages_are_named_for_their_gradients_to_be_summed():
    traced = Traced(Tied())
    assert ties(traced.split(["mix"])) == [[(0, "embed.weight"), (1, "head.weight")]]
    assert ties(traced.split([])) == []  # one stage holds both names: one tensor


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.act = nn.Linear(8, 8), nn.Tanh()

    def forward(self, h):
        return h + self.act(self.linear(h))


class Wrapper(nn.Module):
    """The thinnest wrapper a user writes, around a model whose blocks are one level down;
    its forward has defaulted, keyword-only and ** arguments."""

    def __init__(self):
        super().__init__()
        blocks = nn.ModuleList(Block() for _ in range(4))
        self.model = nn.ModuleDict(
            {"embed": nn.Embedding(10, 8), "blocks": blocks, "head": nn.Linear(8, 10)}
        )

    def forward(self, ids, scale: float = 1.0, *, flag: bool = False, **kwargs):
        h = self.model["embed"](ids) * scale
        for block in self.model["blocks"]:
            h = block(h)
        return self.model["head"](h)


def test_the_cut_opens_the_largest_modules_until_it_has_enough_candidates():
    model = Wrapper()
    assert candidates(model) == [
        "model.embed",
        "model.blocks.0",
        "model.blocks.1",
        "model.blocks.2",
        "model.blocks.3",
        "model.head",
    ]
    deep = [
        "model.embed",
        "model.blocks.0.linear",
        "model.blocks.0.act",
        "model.blocks.1",
        "model.blocks.2",
        "model.blocks.3",
        "model.head",
    ]
    assert candidates(model, want=7) == deep
    # A split point names any module: the modules above it open.
    assert candidates(model, required=["model.blocks.2.act"])[3:6] == [
        "model.blocks.2.linear",
        "model.blocks.2.act",
        "model.blocks.3",
    ]
    traced = Traced(model, required=["model.blocks.2.act"])
    stages = traced.split(["model.blocks.2.act"])
    assert list(stages[1].state_dict()) == [
        "model.blocks.3.linear.weight",
        "model.blocks.3.linear.bias",
        "model.head.weight",
        "model.head.bias",
    ]
    ids = torch.randint(10, (2, 5))
    torch.testing.assert_close(run(stages, ids), model(ids), rtol=0, atol=0)


class Opaque(nn.Module):
    """A block whose forward branches on values: fx cannot trace it, so it stays whole."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


def test_a_module_fx_cannot_trace_stays_whole_and_a_split_inside_it_says_why():
    model = nn.Sequential(OrderedDict(first=nn.Linear(4, 4), opaque=Opaque(), last=nn.Linear(4, 2)))
    traced = Traced(model, want=5)
    assert traced.units == ["first", "opaque", "last"]
    assert "opaque" in traced.whole and "x.sum() > 0" in traced.whole["opaque"]
    with pytest.raises(
        CutError,
        match=r"opaque\.b is not where a stage can begin: opaque is"
        r" kept whole \(TraceError: ",
    ):
        Traced(model, required=["opaque.b"]).split(["opaque.b"])


class LayerDrop(nn.Module):
    """Layers each skipped in training with probability p, as M2M100's encoder does."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p, self.layers = p, nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            if not (self.training and torch.rand([]) < self.p):
                x = layer(x)
        return x


def test_a_forward_that_draws_a_random_number_stays_whole_so_it_draws_every_step():
    """fx would draw once while tracing and freeze which layers run into the graph."""
    model = nn.Sequential(
        OrderedDict(first=nn.Linear(4, 4), drop=LayerDrop(), last=nn.Linear(4, 2))
    )
    traced = Traced(model, want=6)
    assert traced.units == ["first", "drop", "last"]
    assert "torch.rand draws a random value outside the graph" in traced.whole["drop"]
    stages = traced.split(["drop", "last"])
    x = torch.randn(3, 4)
    for seed in range(4):
        torch.manual_seed(seed)
        expected = model(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(run(stages, x), expected, rtol=0, atol=0)


def test_a_vit_whose_blocks_take_defaulted_arguments_compiles_into_stages():
    """timm's ViT once gave `def forward(self, attn_mask=None, is_causal=False, add)`."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        num_classes=5,
        img_size=32,
        patch_size=8,
        depth=3,
        embed_dim=32,
        num_heads=2,
    ).eval()
    traced = Traced(model, want=8)
    stages = [pickle.loads(pickle.dumps(s)) for s in traced.split(["blocks.1", "norm"])]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(run(stages, x), model(x), rtol=0, atol=0)


def test_an_untraceable_forward_is_a_clear_error():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else self.b(x)

    with pytest.raises(CutError, match="cannot trace Branchy's forward between its modules"):
        Traced(Branchy())


def test_parameters_the_forward_never_uses_are_kept_apart():
    class Spare(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.unused = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.b(self.a(x))

    model = Spare()
    stages = Traced(model).split(["b"])
    assert sorted(unused(model, stages)) == ["unused.bias", "unused.weight"]


def test_hugging_face_stages_evaluate_as_the_model_does():
    """Evaluation stays correct for a traced Hugging Face model: in eval mode the stages give
    the model's own output (its ModelOutput class, dropout off), and a timm CNN's BatchNorm
    statistics stay untouched."""
    import timm
    from userpkg.brought import gpt2

    torch.manual_seed(0)
    model = gpt2(layers=3, dropout=0.1)
    traced = Traced(model, want=6)
    assert "transformer.h.1" in traced.units  # a boundary between transformer blocks
    stages = [pickle.loads(pickle.dumps(s)) for s in traced.split(["transformer.h.1"])]
    assert model.config.use_cache  # off while tracing only
    ids = torch.randint(64, (2, 16))
    for m in (model, *stages):
        m.eval()
    with torch.no_grad():
        got, expected = run(stages, ids), model(ids, use_cache=False)
    assert type(got) is type(expected)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=0)

    cnn = timm.create_model("resnet10t", num_classes=5)
    traced = Traced(cnn, want=6)
    stages = [s.eval() for s in traced.split([traced.units[3]])]
    before = {k: v.clone() for k, v in cnn.state_dict().items() if "running" in k}
    with torch.no_grad():
        run(stages, torch.randn(4, 3, 32, 32))
    assert all(torch.equal(cnn.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_a_sliding_attention_window_survives_the_cut(name):
    """A Hugging Face config given to a mask builder stays the config itself (fx would
    rebuild it from its fields, losing the attention kind that decides the mask): Mistral's
    sliding window and Gemma 2's alternating sliding and global layers, over windows longer
    than the attention window, cut between the layers that use it (issue 30)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from userpkg.brought import Logits, mistral

    torch.manual_seed(0)
    if name == "mistral":
        model = mistral(layers=4, window=4)
    else:
        config = Gemma2Config(
            num_hidden_layers=4,
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=64,
            vocab_size=64,
            max_position_embeddings=64,
            sliding_window=4,
        )
        model = Logits(Gemma2ForCausalLM(config))
    traced = Traced(model, want=4)
    stages = [pickle.loads(pickle.dumps(s)) for s in traced.split(["model.model.layers.2"])]
    ids = torch.randint(64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(run(stages, ids), model(ids), rtol=0, atol=0)


class Auxiliary(nn.Module):
    """Inception v3's shape: an auxiliary head run in training only, both logits returned
    as a named tuple in training and the main logits alone in evaluation."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.middle = nn.Conv2d(8, 8, 3)
        self.aux = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
        self.late = nn.Conv2d(8, 8, 3)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        x = self.middle(self.stem(x))
        aux = self.aux(x) if self.training else None
        x = self.head(self.late(x))
        return InceptionOutputs(x, aux) if self.training else x


def test_a_forward_that_branches_on_training_is_cut_in_each_mode():
    """Each stage runs the code of the mode it is in (a branch on `self.training`, which fx
    decides while tracing), and micro-batches' named tuples join (issue 30)."""
    from pipejob.trainer.workloads.cut import join

    torch.manual_seed(0)
    model = Auxiliary()
    traced = Traced(model, want=6)
    assert traced.evaluation is not None and "aux" not in traced.units
    stages = [pickle.loads(pickle.dumps(s)) for s in traced.split(["middle", "late"])]
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        for mode in (True, False):
            for m in (model, *stages):
                m.train(mode)
            got = join([run(stages, part) for part in x.tensor_split(2)])
            expected = join([model(part) for part in x.tensor_split(2)])
            assert type(got) is type(expected)
            for a, b in zip(got if mode else [got], expected if mode else [expected], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_stages_hold_the_models_state_as_the_model_does():
    """A non-persistent buffer stays out of a stage's state dict (pickled too), and a
    parameter the forward uses under other names only (T5's `shared` embedding) is held,
    under every name, by the first stage that uses it (issue 30)."""
    from userpkg.brought import encoder, t5

    model = encoder()
    stages = [pickle.loads(pickle.dumps(s)) for s in Traced(model).split(["head"])]
    assert "feature_mean" in dict(stages[0].named_buffers())
    assert sorted(k for s in stages for k in s.state_dict()) == sorted(model.state_dict())

    model = t5()
    traced = Traced(model, want=6)
    stages = traced.split([traced.units[2], traced.units[-1]])
    held = [n for n, _ in stages[0].named_parameters(remove_duplicate=False)]
    assert "model.shared.weight" in held and "model.encoder.embed_tokens.weight" in held
    assert unused(model, stages) == {}
    assert sorted(k for s in stages for k in s.state_dict()) == sorted(model.state_dict())


class Patches(nn.Module):
    """Returns a mask beside its output only when asked to mask (Hiera's embeddings: no mask
    unless pretraining)."""

    def __init__(self, masked: bool):
        super().__init__()
        self.proj, self.masked = nn.Linear(4, 4), masked

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.proj(x), (x[..., 0] > 0).to(x.dtype) if self.masked else None


class MaybeMasked(nn.Module):
    def __init__(self, masked: bool):
        super().__init__()
        self.patches, self.head = Patches(masked), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, mask = self.patches(x)
        if mask is not None:  # fx sees `patches`' result as one traced value: never None
            h = h * mask.unsqueeze(-1)
        return self.head(h)


@pytest.mark.parametrize("masked", [False, True])
def test_a_module_not_traced_into_that_returns_none_is_tested_as_when_run(masked):
    torch.manual_seed(0)
    model = MaybeMasked(masked)
    stages = Traced(model).split(["head"])
    x = torch.randn(3, 5, 4)
    torch.testing.assert_close(run(stages, x), model(x), rtol=0, atol=0)


class EagerScores(nn.Module):
    """Adds Hugging Face's bidirectional mask to its scores where there is one (SqueezeBERT):
    the builder, a call fx does not trace into, skips a mask that masks nothing."""

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig()
        self.config._attn_implementation = "eager"
        self.embed, self.query, self.head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        mask = create_bidirectional_mask(self.config, h, torch.ones(ids.shape, device=ids.device))
        scores = self.query(h) @ h.transpose(1, 2)
        if mask is not None:
            scores = scores + mask[:, 0]
        return self.head(scores.softmax(-1) @ h)


def test_a_mask_builder_that_skips_a_mask_the_forward_adds_is_cut_exactly():
    torch.manual_seed(0)
    model = EagerScores()
    ids = torch.randint(0, 10, (2, 5))
    assert create_bidirectional_mask(model.config, model.embed(ids), torch.ones(2, 5)) is None
    stages = Traced(model).split(["head"])
    torch.testing.assert_close(run(stages, ids), model(ids), rtol=0, atol=0)


class Counting(nn.Module):
    """Counts its training forwards in a buffer, in place (timm's BatchNormAct2d and its
    `num_batches_tracked`): a module fx traces into, not one of its leaves."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(1)
        return x * 2


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(4, 4), Counting())
        self.second = nn.Sequential(nn.Linear(4, 4), Counting())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)))


@pytest.mark.parametrize("want", [2, 8])  # `first` and `second` whole, or opened
def test_a_buffer_the_forward_updates_in_place_is_updated_when_the_stages_run(want):
    """Tracing changes no buffer (it once counted: a stage's build differed from a plain
    build), and the stages count every training forward as the model does."""
    torch.manual_seed(0)
    model, plain = Counted(), Counted()
    plain.load_state_dict(model.state_dict())
    traced = Traced(model, want=want)
    assert [b.item() for b in model.buffers()] == [0, 0]
    stages = traced.split([traced.units[-1]])
    x = torch.randn(3, 4)
    for _ in range(2):
        torch.testing.assert_close(run(stages, x), plain(x), rtol=0, atol=0)
    held = {k: v for s in stages for k, v in s.state_dict().items()}
    assert {k: v.item() for k, v in held.items() if k.endswith("seen")} == {
        "first.1.seen": 2,
        "second.1.seen": 2,
    }


class Periodic(nn.Module):
    """Checks its buffer's size before using it, in a method its owner calls (timm's EVA
    rotary embedding asserts `self.periods.numel() == dim` in `get_embed`): the trace must
    answer the size, as it did before buffers were traced, and read the buffer when run."""

    def __init__(self):
        super().__init__()
        self.register_buffer("periods", torch.arange(1.0, 5.0), persistent=False)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        assert self.periods.numel() == 4 and self.periods.dim() == 1
        assert self.periods.shape == (4,) and self.periods.size(0) == len(self.periods) == 4
        return x / self.periods[None, :]


class Rotating(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.rope = Periodic()
        self.second = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.rope.embed(self.first(x))))


def test_a_forward_that_checks_a_buffers_size_is_cut_exactly():
    torch.manual_seed(0)
    model = Rotating()
    stages = Traced(model).split(["second"])
    x = torch.randn(3, 4)
    torch.testing.assert_close(run(stages, x), model(x), rtol=0, atol=0)
    model.rope.periods.mul_(2)  # the stages read the buffer when run, not a traced copy
    torch.testing.assert_close(run(stages, x), model(x), rtol=0, atol=0)
