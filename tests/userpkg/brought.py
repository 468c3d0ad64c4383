"""Models users bring from the libraries they use, as a user's package builds them: Hugging
Face transformers and timm, randomly initialised from configs (no download), tiny, with
dropout off (a one-step check compares against one process, whose dropout masks would
differ), raw or under the thinnest wrapper a user writes; a model returning a dict; and token
windows to train the language models on."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB, SEQ = 64, 16


def gpt2(
    layers: int = 2, width: int = 32, tied: bool = True, wrapped: bool = False, dropout: float = 0.0
) -> nn.Module:
    """GPT-2 with its default tied input and output embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=4 * SEQ,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    return Logits(model) if wrapped else model


def llama(layers: int = 2, width: int = 32, wrapped: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=2 * width,
        vocab_size=VOCAB,
        max_position_embeddings=4 * SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = LlamaForCausalLM(config)
    return Logits(model) if wrapped else model


def bert(layers: int = 2, width: int = 32, classes: int = 3, wrapped: bool = False) -> nn.Module:
    """A BERT encoder with a classification head."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=2,
        intermediate_size=2 * width,
        vocab_size=VOCAB,
        max_position_embeddings=4 * SEQ,
        num_labels=classes,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    return Logits(model) if wrapped else model


def mistral(layers: int = 4, width: int = 32, window: int = 4, wrapped: bool = True) -> nn.Module:
    """Mistral with a sliding attention window shorter than the windows it is fed."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=2 * width,
        vocab_size=VOCAB,
        max_position_embeddings=4 * SEQ,
        sliding_window=window,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = MistralForCausalLM(config)
    return Logits(model) if wrapped else model


def mamba(layers: int = 2, width: int = 32) -> nn.Module:
    """Mamba: a state-space scan, whose mixer's initialisation makes tensors on its
    parameters' device."""
    from transformers import MambaConfig, MambaForCausalLM

    return Logits(
        MambaForCausalLM(MambaConfig(num_hidden_layers=layers, hidden_size=width, vocab_size=VOCAB))
    )


def mixtral(layers: int = 2, width: int = 32) -> nn.Module:
    """Mixtral: 4 experts, each token routed to 2 (the experts' grouped matmul)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=2 * width,
        vocab_size=VOCAB,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return Logits(MixtralForCausalLM(config))


def mamba_and_mixtral() -> nn.Module:
    """Mamba and Mixtral trained together, their logits summed: each refused before (issue
    30), in one job."""
    return Sum(mamba(), mixtral())


class Sum(nn.Module):
    """Models' outputs summed (an ensemble)."""

    def __init__(self, *models: nn.Module):
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return sum(model(ids) for model in self.models)


def t5(layers: int = 2, width: int = 32) -> nn.Module:
    """T5, whose `shared` embedding is the encoder's, the decoder's and the output head's,
    behind the wrapper that feeds the ids to both sides."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=width,
        d_kv=width // 2,
        d_ff=2 * width,
        num_layers=layers,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        tie_word_embeddings=True,
    )
    return Both(T5ForConditionalGeneration(config))


class Both(nn.Module):
    """An encoder-decoder's wrapper: the ids in on both sides, logits out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, decoder_input_ids=ids).logits


class Encoder(nn.Module):
    """torch's own nn.TransformerEncoder classifying token windows, with a non-persistent
    buffer (a feature mean subtracted before the head, not part of the model's state)."""

    def __init__(self, classes: int = 2, width: int = 32, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.register_buffer("feature_mean", torch.full((width,), 0.5), persistent=False)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1) - self.feature_mean)


def encoder(classes: int = 2) -> nn.Module:
    return Encoder(classes)


class Auxiliary(nn.Module):
    """Inception v3's shape, with weight-normed convolutions: an auxiliary head run in
    training only, both logits returned as a named tuple in training, the main logits alone
    in evaluation."""

    def __init__(self, classes: int = 10):
        super().__init__()
        norm = nn.utils.parametrizations.weight_norm
        self.stem = nn.Sequential(norm(nn.Conv2d(3, 8, 3, stride=2)), nn.ReLU())
        self.middle = nn.Sequential(norm(nn.Conv2d(8, 16, 3)), nn.ReLU())
        self.aux = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes))
        self.late = nn.Sequential(norm(nn.Conv2d(16, 16, 3)), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes))

    def forward(self, x: torch.Tensor):
        from torchvision.models.inception import InceptionOutputs

        x = self.middle(self.stem(x))
        aux = self.aux(x) if self.training else None
        logits = self.head(self.late(x))
        return InceptionOutputs(logits, aux) if self.training else logits


def auxiliary(classes: int = 10) -> nn.Module:
    return Auxiliary(classes)


def auxiliary_loss(weight: float = 0.4):
    """The user's loss of an auxiliary head: main + weight * auxiliary in training, the main
    logits' alone in evaluation (what the model returns then)."""

    def loss(outputs, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(outputs, tuple):
            main = nn.functional.cross_entropy(outputs.logits, labels)
            return main + weight * nn.functional.cross_entropy(outputs.aux_logits, labels)
        return nn.functional.cross_entropy(outputs, labels)

    return loss


class Logits(nn.Module):
    """The wrapper users write around a Hugging Face model: token ids in, logits out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def timm_model(name: str, classes: int = 10, **kwargs) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=classes, **kwargs)


class DictModel(nn.Module):
    """A classifier whose forward returns a dict: logits, and features a loss may use."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.hidden(self.features(x)))
        return {"logits": self.head(h), "features": h}


def dict_model(classes: int = 10) -> nn.Module:
    return DictModel(classes)


def logits_loss():
    """A user's loss over what a Hugging Face model returns (a ModelOutput): per token for a
    language model's (batch, length, vocab) logits, per sample for a classifier's."""

    def loss(outputs, labels: torch.Tensor) -> torch.Tensor:
        scores = outputs.logits if hasattr(outputs, "logits") else outputs["logits"]
        return nn.functional.cross_entropy(scores.flatten(0, -2), labels.flatten())

    return loss


class Windows(Dataset):
    """Seeded token windows: the input is tokens 0..SEQ-1 of window i, the label the next
    token at each position (a language model) or, with `classes`, one class per window."""

    def __init__(self, size: int, seed: int, classes: int = 0):
        self.size, self.seed, self.classes = size, seed, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        window = torch.randint(VOCAB, (SEQ + 1,), generator=g)
        if self.classes:
            return window[:-1], int(window[0]) % self.classes
        return window[:-1], window[1:]


def windows(split: str, size: int = 64, classes: int = 0) -> Windows:
    return Windows(size, seed=0 if split == "train" else 1, classes=classes)


class Branchy(nn.Module):
    """A model whose own forward branches on a tensor's value: it cannot be cut."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3 * 32 * 32, 10), nn.Linear(3 * 32 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


def branchy() -> nn.Module:
    return Branchy()
