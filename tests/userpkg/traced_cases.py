"""Models and factories for issue 56's failure classes on the traced path
(tests/test_traced_*.py): each as a user's or a library's code writes it."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import interpolate


def failing_factory(width: int = 4) -> nn.Module:
    """A factory that raises on its own line (a user's typo, a missing file)."""
    sizes = {"small": width}
    return nn.Linear(sizes["large"], width)  # the user's line: KeyError 'large'


class DictInputs(nn.Module):
    """An audio seq2seq model's habit: one dict of named inputs, {features, tokens}."""

    def __init__(self, width: int = 8, vocab: int = 11, classes: int = 3):
        super().__init__()
        self.encode = nn.Linear(width, width)
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, batch: dict) -> torch.Tensor:
        h = self.encode(batch["features"]) + self.embed(batch["tokens"]).mean(1)
        return self.head(torch.relu(self.mix(h)))


def dict_label_loss(outputs: torch.Tensor, labels: dict) -> torch.Tensor:
    """A loss of a label dict, {cls}."""
    return nn.functional.cross_entropy(outputs, labels["cls"])


def dict_labels() -> object:
    """spec.loss.import's factory of `dict_label_loss`."""
    return dict_label_loss


class DictData(torch.utils.data.Dataset):
    """Samples of named inputs and a named label: ({features, tokens}, {cls})."""

    def __init__(self, size: int, width: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.features = torch.randn(size, width, generator=g)
        self.tokens = torch.randint(0, 11, (size, 5), generator=g)
        self.cls = (self.features[:, 0] > 0).long() + (self.tokens[:, 0] > 5).long()

    def __len__(self) -> int:
        return len(self.cls)

    def __getitem__(self, i: int) -> tuple[dict, dict]:
        return {"features": self.features[i], "tokens": self.tokens[i]}, {"cls": self.cls[i]}


def dict_data(split: str, size: int = 256) -> DictData:
    return DictData(size if split == "train" else size // 4, seed=0 if split == "train" else 1)


def dict_inputs() -> nn.Module:
    return DictInputs()


def gpt_loss() -> object:
    """spec.loss.import for a `(logits, loss)` GPT called without targets: cross-entropy of
    the positions it gives logits for (nanoGPT and llm.c: the last; minGPT: every one)."""

    def loss(outputs: tuple, labels: torch.Tensor) -> torch.Tensor:
        logits, _ = outputs
        labels = labels[:, -logits.size(1) :]
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return loss


def frozen_tied_lm(width: int = 32) -> nn.Module:
    """LoRA's habit over a tied embedding: the embedding, which the output layer reuses, is
    frozen; the blocks train (userpkg.tied's model)."""
    from userpkg.tied import TiedLM

    model = TiedLM(width)
    model.embed.weight.requires_grad_(False)
    return model


class UnpacksShape(nn.Module):
    """A diffusion UNet's habit: a traced shape unpacked with the input's device."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(4, 4, 1)
        self.c = nn.Conv2d(4, 4, 1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        b, c, h, w, device = *img.shape, img.device
        x = self.a(img)
        rows = torch.arange(h * w, device=device).float().view(1, 1, h, w) / (c * h * w)
        x = self.b(x + rows)
        return self.c(x).reshape(b, -1)


class Quantizer(nn.Module):
    """A VQ layer's output: the quantized value, its commitment loss and its codes."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.proj(x)
        return q, (q - x).pow(2).mean(), torch.argmax(q, -1)


class UnpacksOutput(nn.Module):
    """A VQ model's habit: a submodule's tuple output unpacked with a starred name."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.quantizer = Quantizer()
        self.dec = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enc(x)
        x, *rest = self.quantizer(x)
        return self.dec(x) + rest[0]


class SkipLayer(nn.Module):
    """MONAI DynUNet's skip layer: its forward writes a deep-supervision head into a Python
    list that its model's forward reads."""

    def __init__(self, heads: list, inner: nn.Module | None = None):
        super().__init__()
        self.heads = heads
        self.down = nn.Conv2d(2, 2, 3, padding=1)
        self.inner = inner if inner is not None else nn.Identity()
        self.up = nn.Conv2d(2, 2, 3, padding=1)
        self.super_head = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up(self.inner(self.down(x)))
        self.heads[0] = self.super_head(x)
        return x


class DeepSupervision(nn.Module):
    """DynUNet's forward (MONAI, dynunet.py): in training, the output stacked with the heads
    its skip layers wrote, each interpolated to the output's size by the function MONAI
    imports at module level (`from torch.nn.functional import interpolate`)."""

    def __init__(self):
        super().__init__()
        self.heads: list = [torch.rand(1)]
        self.skip_layers = SkipLayer(self.heads, SkipLayer([torch.rand(1)]))
        self.output_block = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.output_block(self.skip_layers(x))
        if self.training:
            return torch.stack([out, interpolate(self.heads[0], out.shape[2:])], dim=1)
        return out


class Tagged(torch.Tensor):
    """MONAI's MetaTensor's habit: a torch.Tensor subclass that carries metadata, and whose
    every operation's result is one too (torch.Tensor's own __torch_function__)."""

    meta: dict

    @staticmethod
    def __new__(cls, data: torch.Tensor, meta: dict | None = None) -> Tagged:
        tagged = torch.Tensor._make_subclass(cls, data)
        tagged.meta = dict(meta or {})
        return tagged


class TaggedImages(torch.utils.data.Dataset):
    """MONAI's ArrayDataset's habit: images as Tagged tensors (with their file's name)."""

    def __init__(self, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 2, 8, 8, generator=g)
        self.labels = (self.images.mean((1, 2, 3)) > 0).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tagged, torch.Tensor]:
        return Tagged(self.images[i], {"filename": f"image{i}.nii"}), self.labels[i]


def tagged_images(split: str, size: int = 64) -> TaggedImages:
    return TaggedImages(size if split == "train" else size // 4, seed=0 if split == "train" else 1)


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 2),
    )
