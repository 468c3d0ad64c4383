"""The model zoos benchmarks/conformance.py checks, none of whose models were written here:

- torch: every torch.nn module with parameters (and the parametrizations, lazy modules and
  values made in __init__), each between two linear layers, so the cut falls around it;
- torchvision: every classification builder, 10 classes, at a small image size;
- timm: one model of every family (module), its smallest by parameter count, 10 classes, at
  the small image size where it runs at it;
- transformers: every architecture an auto class builds (causal LM, seq2seq LM, sequence
  classification, image classification), from a tiny config derived from its config class's
  defaults (2 layers, width 32, 2 heads, a vocabulary of 128, ...; a sliding window of 4),
  the first of those it builds and runs with (sub-configs made tiny too, then not);
- the libraries users bring beside them (diffusers, peft, open_clip, x_transformers,
  vit_pytorch, segmentation_models_pytorch): benchmarks/_libraries.py.

An entry is (factory, sample): a model with no arguments, and a batch of 4 inputs for it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import _libraries
import torch
from torch import nn

Entry = tuple[Callable[[], nn.Module], Callable[[], Any]]
ZOOS = ("torch", "torchvision", "timm", "transformers", *_libraries.LIBRARIES)
BATCH = 4
SEQ = 16
SMALL_IMAGE = 64


def names(zoo: str) -> list[str]:
    """The rows of a zoo, in order."""
    if zoo == "torch":
        return list(_torch_entries())
    if zoo == "torchvision":
        import torchvision

        return torchvision.models.list_models(module=torchvision.models)
    if zoo == "timm":
        import timm

        return sorted(timm.list_modules())
    if zoo == "transformers":
        return [f"{task}:{kind}" for task, mapping in _tasks().items() for kind in mapping]
    if zoo in _libraries.LIBRARIES:
        return _libraries.names(zoo)
    raise ValueError(f"unknown zoo {zoo!r}: one of {', '.join(ZOOS)}")


def entry(zoo: str, name: str) -> tuple[str, Entry]:
    """The row's model (its name as the table shows it) and its sample."""
    if zoo == "torch":
        return name, _torch_entries()[name]
    if zoo == "torchvision":
        return name, _torchvision(name)
    if zoo == "timm":
        return _timm(name)
    if zoo in _libraries.LIBRARIES:
        return name, _libraries.entry(zoo, name)
    return name, _transformers(name)


def _images(size: int, channels: int = 3) -> Callable[[], torch.Tensor]:
    def sample() -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        return torch.randn(BATCH, channels, size, size, generator=g)

    return sample


def _tokens(vocab: int, low: int = 0) -> Callable[[], torch.Tensor]:
    def sample() -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        return torch.randint(low, vocab, (BATCH, SEQ), generator=g)

    return sample


# ---------------------------------------------------------------------------------- torch


class Around(nn.Module):
    """A module between two linear layers: a feature vector in, one out, as the module's
    input and output ask (`before`, `after` reshape)."""

    def __init__(
        self,
        module: nn.Module,
        width: int,
        before: Callable[[torch.Tensor], Any],
        after: Callable[[Any], torch.Tensor],
    ):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.module = module
        self.out = nn.LazyLinear(4)
        self.before, self.after = before, after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.after(self.module(self.before(self.inp(x)))))


def _around(
    make: Callable[[], nn.Module],
    width: int,
    before: Callable[[torch.Tensor], Any],
    after: Callable[[Any], torch.Tensor] = lambda y: y.flatten(1),
) -> Entry:
    def factory() -> nn.Module:
        model = Around(make(), width, before, after)
        model(torch.zeros(BATCH, 8))  # the dry run that makes the head's parameters
        return model

    def sample() -> torch.Tensor:
        return torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(0))

    return factory, sample


class _Stored(nn.Module):
    """Values made in __init__ rather than reset_parameters: a parameter drawn before it is
    registered, one computed from another, and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))
        self.u = nn.Parameter(self.w.detach() * 0.5)
        self.register_buffer("mean", self.w.detach().mean(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + x @ self.u - self.mean


class _Encoder(nn.Module):
    """The issue's model: an embedding, torch's own TransformerEncoder (which deep-copies
    its layer), a mean-pool, a non-persistent buffer, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.register_buffer("feature_mean", torch.full((32,), 0.5), persistent=False)
        self.head = nn.Linear(32, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1) - self.feature_mean)


def _torch_entries() -> dict[str, Entry]:
    P = nn.utils.parametrizations
    seq = lambda x: x.view(x.shape[0], 4, -1)  # noqa: E731 (batch, 4 positions, features)
    first = lambda y: y[0].flatten(1)  # noqa: E731 (an RNN's or attention's output)
    image = lambda x: x.view(x.shape[0], -1, 4, 4)  # noqa: E731
    volume = lambda x: x.view(x.shape[0], -1, 2, 2, 4)  # noqa: E731
    line = lambda x: x.view(x.shape[0], -1, 16)  # noqa: E731
    ids = lambda x: (x.abs() * 10).long().clamp(max=9)  # noqa: E731
    flat = lambda x: x  # noqa: E731
    return {
        "Linear": _around(lambda: nn.Linear(16, 16), 16, flat),
        "Bilinear": _around(lambda: _Pair(nn.Bilinear(16, 16, 8)), 16, flat),
        "Conv1d": _around(lambda: nn.Conv1d(2, 4, 3, padding=1), 32, line),
        "Conv2d": _around(lambda: nn.Conv2d(2, 4, 3, padding=1), 32, image),
        "Conv3d": _around(lambda: nn.Conv3d(2, 2, 3, padding=1), 32, volume),
        "ConvTranspose1d": _around(lambda: nn.ConvTranspose1d(2, 2, 3), 32, line),
        "ConvTranspose2d": _around(lambda: nn.ConvTranspose2d(2, 2, 3), 32, image),
        "ConvTranspose3d": _around(lambda: nn.ConvTranspose3d(2, 2, 3), 32, volume),
        "Embedding": _around(lambda: nn.Embedding(10, 4), 4, ids),
        "EmbeddingBag": _around(lambda: nn.EmbeddingBag(10, 4, mode="mean"), 4, ids),
        "BatchNorm1d": _around(lambda: nn.BatchNorm1d(16), 16, flat),
        "BatchNorm2d": _around(lambda: nn.BatchNorm2d(2), 32, image),
        "BatchNorm3d": _around(lambda: nn.BatchNorm3d(2), 32, volume),
        "InstanceNorm2d": _around(
            lambda: nn.InstanceNorm2d(2, affine=True, track_running_stats=True), 32, image
        ),
        "GroupNorm": _around(lambda: nn.GroupNorm(2, 4), 64, image),
        "LayerNorm": _around(lambda: nn.LayerNorm(16), 16, flat),
        "RMSNorm": _around(lambda: nn.RMSNorm(16), 16, flat),
        "PReLU": _around(lambda: nn.PReLU(16), 16, flat),
        "MultiheadAttention": _around(
            lambda: _Self(nn.MultiheadAttention(4, 2, batch_first=True)), 16, seq, first
        ),
        "TransformerEncoderLayer": _around(
            lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True), 16, seq
        ),
        "TransformerDecoderLayer": _around(
            lambda: _Self(nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True)),
            16,
            seq,
        ),
        "TransformerEncoder": (_Encoder, _tokens(64)),
        "TransformerDecoder": _around(
            lambda: _Self(
                nn.TransformerDecoder(
                    nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True), 2
                )
            ),
            16,
            seq,
        ),
        "Transformer": _around(
            lambda: _Self(nn.Transformer(4, 2, 2, 2, 8, dropout=0.0, batch_first=True)), 16, seq
        ),
        "RNN": _around(lambda: nn.RNN(4, 4, 2, batch_first=True), 16, seq, first),
        "LSTM": _around(
            lambda: nn.LSTM(4, 6, 2, batch_first=True, proj_size=3, bidirectional=True),
            16,
            seq,
            first,
        ),
        "GRU": _around(lambda: nn.GRU(4, 4, 2, batch_first=True), 16, seq, first),
        "RNNCell": _around(lambda: nn.RNNCell(16, 8), 16, flat),
        "LSTMCell": _around(lambda: nn.LSTMCell(16, 8), 16, flat, first),
        "GRUCell": _around(lambda: nn.GRUCell(16, 8), 16, flat),
        "AdaptiveLogSoftmaxWithLoss": _around(
            lambda: _Log(nn.AdaptiveLogSoftmaxWithLoss(16, 12, [4, 8])), 16, flat
        ),
        "LazyLinear": _around(lambda: nn.LazyLinear(8), 16, flat),
        "LazyConv2d": _around(lambda: nn.LazyConv2d(3, 3, padding=1), 32, image),
        "LazyBatchNorm1d": _around(lambda: nn.LazyBatchNorm1d(), 16, flat),
        "weight_norm": _around(lambda: P.weight_norm(nn.Conv2d(2, 4, 3, padding=1)), 32, image),
        "spectral_norm": _around(lambda: P.spectral_norm(nn.Linear(16, 16)), 16, flat),
        "orthogonal": _around(lambda: P.orthogonal(nn.Linear(16, 16)), 16, flat),
        "weight_norm (deprecated)": _around(
            lambda: nn.utils.weight_norm(nn.Linear(16, 16)), 16, flat
        ),
        "spectral_norm (deprecated)": _around(
            lambda: nn.utils.spectral_norm(nn.Linear(16, 16)), 16, flat
        ),
        "values made in __init__": _around(_Stored, 16, flat),
    }


class _Pair(nn.Module):
    """A two-input module (Bilinear) on one input twice."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x, x)


class _Self(nn.Module):
    """An attention or decoder module on one sequence (its query, key and value, or its
    target and memory, alike)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> Any:
        if isinstance(self.module, nn.MultiheadAttention):
            return self.module(x, x, x)
        return self.module(x, x)


class _Log(nn.Module):
    """AdaptiveLogSoftmaxWithLoss's log-probabilities of every class."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module.log_prob(x)


# ---------------------------------------------------------------------------- torchvision

# Builders that need more than the small image (or take its size as an argument).
_IMAGE = {"inception_v3": 299, "googlenet": 224, "maxvit_t": 224}
_VIT = {"vit_b_16": 32, "vit_b_32": 32, "vit_l_16": 32, "vit_l_32": 32, "vit_h_14": 28}


def _torchvision(name: str) -> Entry:
    from torchvision.models import get_model

    size = _IMAGE.get(name, _VIT.get(name, SMALL_IMAGE))
    extra = {"image_size": size} if name in _VIT else {}

    def factory() -> nn.Module:
        return get_model(name, weights=None, num_classes=10, **extra)

    return factory, _images(size)


# ----------------------------------------------------------------------------------- timm


def _timm(family: str) -> tuple[str, Entry]:
    """The family's smallest model (by parameters, counted on the meta device), or the
    model of that name."""
    import timm

    if family not in timm.list_modules():
        return family, _timm_model(family)
    sizes = {}
    for name in timm.list_models(module=family):
        try:
            with torch.device("meta"):
                model = timm.create_model(name, pretrained=False, num_classes=10)
        except Exception:  # a model its own library cannot build is left out
            continue
        sizes[name] = sum(p.numel() for p in model.parameters())
    if not sizes:
        raise ValueError(f"timm builds no model of {family}")
    name = min(sizes, key=lambda n: (sizes[n], n))
    return f"{family} ({name})", _timm_model(name)


def _timm_model(name: str) -> Entry:
    import timm

    config = timm.get_pretrained_cfg(name)
    channels, size, _ = config.input_size if config is not None else (3, 224, 224)
    smallest = getattr(config, "min_input_size", None) or (channels, size, size)
    extra, size = _timm_small(name, channels, size, smallest[1])

    def factory() -> nn.Module:
        return timm.create_model(name, pretrained=False, num_classes=10, **extra)

    return factory, _images(size, channels)


def _timm_small(name: str, channels: int, size: int, smallest: int) -> tuple[dict[str, Any], int]:
    """The small image a timm model runs at (float64 at 224x224 takes minutes a model on 2
    cores, and the cut is the same at any size): given as `img_size` to a model that takes
    it (vision transformers), else as the input of one that takes any; found by a forward
    on the meta device. Else the `smallest` its config says it takes (Gemma 4's ViT pools
    3x3 cells of 16-pixel patches: 96, where its own 768 is 64 times the tokens); else the
    model's own size."""
    import timm

    for small in dict.fromkeys([SMALL_IMAGE, max(smallest, SMALL_IMAGE)]):
        for extra in ({"img_size": small}, {}):
            try:
                with torch.device("meta"):
                    model = timm.create_model(name, pretrained=False, num_classes=10, **extra)
                    model(torch.empty(1, channels, small, small))
                return extra, small
            except Exception:  # a model that needs its own size keeps it
                continue
    return {}, size


# --------------------------------------------------------------------------- transformers


def _tasks() -> dict[str, dict[str, Any]]:
    from transformers.models.auto import modeling_auto as auto

    return {
        "causal": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "seq2seq": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        "classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "image": auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    }


VOCAB = 128
TINY = 20e6  # parameters: a tiny config that keeps more is taken as not made tiny
_SIZES = {
    1: ("n_group", "topk_group", "first_k_dense_replace"),
    2: (
        "num_hidden_layers",
        "num_layers",
        "n_layer",
        "n_layers",
        "encoder_layers",
        "decoder_layers",
        "num_encoder_layers",
        "num_decoder_layers",
        "num_attention_heads",
        "n_head",
        "n_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "num_key_value_heads",
        "num_kv_heads",
        "multi_query_group_num",
        "num_experts_per_tok",
        "moe_k",
        "num_heads",
    ),
    4: (
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
        "moe_num_experts",
        "sliding_window",
    ),
    8: ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"),
    16: (
        "head_dim",
        "d_kv",
        "kv_channels",
        "attention_head_size",
        "v_head_dim",
        "q_lora_rank",
        "kv_lora_rank",
    ),
    32: (
        "hidden_size",
        "d_model",
        "n_embd",
        "embed_dim",
        "embedding_size",
        "dim",
        "word_embed_proj_dim",
        "projection_dim",
    ),
    64: (
        "intermediate_size",
        "d_ff",
        "ffn_dim",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "n_inner",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "ffn_hidden_size",
    ),
}
_LAYERS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_TOKENS = (
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
)


def tiny(config: Any, sub_configs: bool = True) -> dict[str, Any]:
    """Keyword arguments that make a config class's defaults tiny: the sizes above where the
    config has them, per-layer lists cut to the layers kept, a vocabulary of VOCAB (special
    token ids inside it), and (`sub_configs`) a text or vision tower likewise."""
    from transformers import PretrainedConfig

    values = config.to_dict()
    kwargs: dict[str, Any] = {}
    for size, keys in _SIZES.items():
        for key in keys:
            value = values.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                kwargs[key] = min(value, size) if key == "sliding_window" else size
    layers = next((values[k] for k in _LAYERS if isinstance(values.get(k), int)), None)
    per_layer = [
        k for k, v in values.items() if isinstance(v, list) and layers and len(v) == layers
    ]
    if per_layer:  # layer_types, mlp_layer_types, ...: the first layer and the first other kind
        kinds = values["layer_types"] if "layer_types" in per_layer else values[per_layer[0]]
        other = next((i for i, kind in enumerate(kinds) if kind != kinds[0]), 1)
        for key in per_layer:
            kwargs[key] = [values[key][0], values[key][other]]
    if isinstance(values.get("vocab_size"), int):
        kwargs["vocab_size"] = VOCAB
        for key in _TOKENS:
            if isinstance(values.get(key), int) and values[key] >= VOCAB:
                kwargs[key] = VOCAB - 1 - _TOKENS.index(key)
        if "pad_token_id" in values and values["pad_token_id"] is None:
            kwargs["pad_token_id"] = 0  # classifying a batch needs one
    if isinstance(values.get("image_size"), int):
        kwargs["image_size"] = 64 if values.get("patch_size", 16) <= 16 else values["image_size"]
    if isinstance(values.get("depths"), list):
        kwargs["depths"] = [1] * len(values["depths"])
    for key in ("hidden_sizes", "embed_dims"):
        if isinstance(values.get(key), list):
            kwargs[key] = [16 * (i + 1) for i in range(len(values[key]))]
    if isinstance(values.get("num_heads"), list):
        kwargs["num_heads"] = [1] * len(values["num_heads"])
    if sub_configs:
        for key, value in vars(config).items():
            if isinstance(value, PretrainedConfig):  # a sub-config: its own tiny version
                kwargs[key] = {**value.to_dict(), **tiny(value)}
    return kwargs


class Both(nn.Module):
    """An encoder-decoder fed the ids on both sides (the issue's T5 wrapper)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> Any:
        return self.model(input_ids=ids, decoder_input_ids=ids)


def _transformers(row: str) -> Entry:
    """The architecture from the first tiny config it builds and runs with: its defaults
    made tiny (sub-configs too, then not)."""
    import transformers
    from transformers import AutoConfig

    task, kind = row.split(":", 1)
    name = _tasks()[task][kind]
    cls = getattr(transformers, name if isinstance(name, str) else name[0])
    defaults = AutoConfig.for_model(kind)
    failed: Exception | None = None
    for sub_configs in (True, False):
        try:
            config = type(defaults)(**{**_arguments(defaults), **tiny(defaults, sub_configs)})
            entry = _hugging_face(task, cls, config)
            factory, sample = entry
            with torch.device("meta"):
                count = sum(p.numel() for p in factory().parameters())
            if count > TINY:
                raise ValueError(f"its tiny config still has {count / 1e6:.0f}M parameters")
            with torch.no_grad():
                factory().eval()(sample())
            return entry
        except Exception as e:  # the next config; else its own library's error
            failed = failed or e
    assert failed is not None
    raise failed


def _hugging_face(task: str, cls: type, config: Any) -> Entry:
    if task == "image":
        vision = getattr(config, "vision_config", config)
        size = getattr(vision, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        sample = _images(size, getattr(vision, "num_channels", 3))
    else:
        sample = _tokens(getattr(config, "vocab_size", VOCAB), low=3)

    def factory() -> nn.Module:
        model = cls(config)
        return Both(model) if task == "seq2seq" else model

    return factory, sample


def _arguments(config: Any) -> dict[str, Any]:
    """What the config class takes of its defaults' own values (those its __init__ names)."""
    accepted = inspect.signature(type(config).__init__).parameters
    return {k: v for k, v in config.to_dict().items() if k in accepted}
