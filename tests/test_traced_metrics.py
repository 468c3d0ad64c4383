"""Held-out figures skip the labels the loss ignores (cross-entropy's ignore_index, -100):
masked language models, padded sequences, node classification with unlabelled nodes
(issue 56, class 7)."""

from __future__ import annotations

import math

import pytest
import torch

from pipejob.trainer.workloads.metrics import CLASSIFICATION, Tally, cross_entropy


def test_accuracy_and_perplexity_skip_ignored_labels():
    """Half the tokens are -100: accuracy is over the other half, and the loss (hence the
    perplexity) is weighted by the tokens the loss counted."""
    labels = torch.tensor([[1, 2, -100, -100], [3, -100, 1, -100]])
    guess = torch.tensor([[1, 0, 0, 0], [3, 0, 0, 0]])  # right on 2 of the 4 labelled tokens
    scores = torch.nn.functional.one_hot(guess, 4).float() * 10
    tally = Tally(CLASSIFICATION)
    tally.add(scores, labels, cross_entropy)
    tally.add(scores, torch.full_like(labels, -100), cross_entropy)  # nothing labelled
    got = tally.result()
    assert got["accuracy"] == pytest.approx(0.5)
    assert got["loss"] == pytest.approx(float(cross_entropy(scores, labels)), rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-4)
    assert got["samples"] == 4


def test_a_classifier_with_unlabelled_samples_scores_the_labelled_ones():
    """A GCN's nodes, half unlabelled: accuracy over the labelled half, not 0.5 of it."""
    labels = torch.tensor([0, 1, -100, -100])
    scores = torch.nn.functional.one_hot(torch.tensor([0, 1, 0, 0]), 2).float() * 10
    tally = Tally(CLASSIFICATION)
    tally.add(scores, labels, cross_entropy)
    assert tally.result()["accuracy"] == pytest.approx(1.0)
