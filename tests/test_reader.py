"""The first stage's data (pipeline/reader.py), in this process: the rounds a Reader reads
ahead of the forwards, and the position a checkpoint keeps while a batch is read ahead.
Through real worlds: tests/test_first_stage_reads.py."""

from __future__ import annotations

import pytest
import torch
from test_feed import import_spec, make_spec

from pipejob.trainer.pipeline.reader import HELD_OUT, Reader, Source
from pipejob.trainer.workloads.data import Feed

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


def test_a_reader_hands_out_the_feed_s_batches_in_micro_batches_and_keeps_the_labels():
    spec = make_spec(batch_size=6, image_size=8)
    reader = Reader(Source(spec, 0), CPU)
    try:
        with Feed(spec) as feed:
            for round in range(1, 4):
                x, y = feed.batch()
                assert reader.read(round, 4) == 6
                parts = [reader.input(round, mb)[0] for mb in range(4)]
                assert [len(p) for p in parts] == [2, 2, 1, 1]  # tensor_split's sizes
                assert torch.equal(torch.cat(parts), x)
                assert torch.equal(reader.labels(round), y)
    finally:
        reader.close()


def test_the_position_leaves_out_the_batch_read_ahead_and_a_resume_continues_there():
    spec = import_spec(workers=2, batch_size=4)
    with Feed(spec) as feed:
        expected = [feed.batch()[1] for _ in range(6)]
    reader = Reader(Source(spec, 0), CPU)
    try:
        for round in (1, 2, 3):
            reader.read(round, 1)
            assert torch.equal(reader.labels(round), expected[round - 1])
        state = reader.state()  # batch 4 is being read ahead: not counted
        assert state["samples"] == 3 * 4
    finally:
        reader.close()
    resumed = Reader(Source(spec, 0), CPU)
    try:
        resumed.load_state(state)
        for round in (4, 5, 6):
            resumed.read(round, 2)
            assert torch.equal(resumed.labels(round), expected[round - 1])
        resumed.load_state(state)  # again, while a batch is read ahead: it is dropped
        resumed.read(7, 2)
        assert torch.equal(resumed.labels(7), expected[3])
    finally:
        resumed.close()


def test_a_given_batch_and_a_held_out_pass_that_ends():
    spec = make_spec(batch_size=4, image_size=8)
    reader = Reader(Source(spec, 0), CPU)
    try:
        x, y = torch.randn(5, 3, 8, 8, dtype=torch.float64), torch.arange(5)
        assert reader.read(1, 2, given=(x, y)) == 5
        assert torch.equal(reader.input(1, 0)[0], x[:3])  # as given: dtype and all
        assert reader.held_out() == "held-out synthetic 8x8 images, 10 classes"
        reader.start_held_out(3)
        counts = [reader.read(round, 2, HELD_OUT) for round in range(2, 6)]
        assert counts == [4, 4, 4, 0]  # three batches, then the end of the pass
    finally:
        reader.close()


def test_a_reader_without_a_source_takes_only_given_batches():
    reader = Reader(None, CPU)
    with pytest.raises(RuntimeError, match="no data source"):
        reader.read(1, 2)
    assert reader.read(1, 2, given=(torch.zeros(2, 3), torch.zeros(2))) == 2
    reader.close()
