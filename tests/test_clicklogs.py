"""A HybridJob's data at any size: the stream's start-up does not grow with the batch or the
share, and click logs (plain or gzip, one file, a list or a glob) are streamed: each trainer
reads its own disjoint lanes in bounded memory, an epoch reads every line once, and a resumed
stream continues exactly."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipejob.trainer.workloads import samples

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class Numbered:
    """`size` samples, sample i holding its own number as its one id."""

    size: int

    def sample(self, i: int) -> samples.Sample:
        return (), {"f": [i]}, 0.0


@pytest.mark.parametrize(("batch", "share"), [(8, (0, 1)), (1024, (1, 2)), (4096, (3, 4))])
def test_each_epoch_s_order_is_computed_once_whatever_the_batch_and_share(
    monkeypatch: pytest.MonkeyPatch, batch: int, share: tuple[int, int]
) -> None:
    """The order of an epoch is a shuffle of the whole data: computed once per epoch, not
    once per sample of the share (which made start-up grow with the share times the data)."""
    computed: list[int] = []
    real = samples.order

    def counted(size: int, seed: int, epoch: int) -> list[int]:
        computed.append(epoch)
        return real(size, seed, epoch)

    monkeypatch.setattr(samples, "order", counted)
    data = Numbered(3000)
    reader = samples.stream(data, batch, share, 0, ["f"], True)
    epochs: set[int] = set()
    while len(epochs) < 3:
        epochs.update(next(reader).epochs)
    assert computed == sorted(epochs), computed  # each epoch once, in order
