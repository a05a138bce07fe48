"""Copy streams: the CPU's runs copies at once, the test stream as late as allowed."""

from __future__ import annotations

import pytest
import torch

from ucm.testing.streams import LaggingStream
from ucm.transfer.paged import PagedKV
from ucm.transfer.streams import COMPLETE, DeviceStream, HostStream, copy_stream


def test_the_cpu_stream_runs_each_copy_at_once() -> None:
    stream = copy_stream(torch.device("cpu"))
    assert isinstance(stream, HostStream)
    data = torch.zeros(4)
    stream.follow_compute()
    stream.run(lambda: data.fill_(1))
    assert bool((data == 1).all())
    assert stream.record() is COMPLETE


def test_the_lagging_stream_runs_copies_in_order_when_an_event_needs_them() -> None:
    stream = LaggingStream()
    order: list[int] = []
    stream.run(lambda: order.append(1))
    first = stream.record()
    stream.run(lambda: order.append(2))
    second = stream.record()
    assert order == []
    first.synchronize()
    assert order == [1]
    stream.make_compute_wait(second)  # On the CPU the compute stream is this thread.
    assert order == [1, 2] and stream.ran == 2
    first.synchronize()  # Reached already: nothing runs twice.
    assert order == [1, 2]


def test_a_broken_lagging_stream_lets_the_forward_pass_run_ahead() -> None:
    stream = LaggingStream(compute_waits=False)
    pages = PagedKV([("layer.0", torch.zeros(8, 2, 32, 4), 0)])
    rows = torch.ones((1, pages.block_bytes), dtype=torch.uint8)
    stream.run(lambda: pages.scatter(pages.layers[0], [3], rows, 1))
    loaded = stream.record()
    stream.make_compute_wait(loaded)
    assert not pages.layers[0].tensor.any()  # What the forward pass would read.
    loaded.synchronize()
    assert pages.layers[0].tensor[3].view(torch.uint8).eq(1).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_copies_on_their_own_stream_round_trip_exactly() -> None:
    device = torch.device("cuda")
    stream = copy_stream(device)
    assert isinstance(stream, DeviceStream)
    kv = torch.randn(64, 4, 16, 32, device=device)
    target = torch.zeros_like(kv)
    source, destination = PagedKV([("l", kv, 0)]), PagedKV([("l", target, 0)])
    rows = torch.empty((8, source.block_bytes), dtype=torch.uint8, pin_memory=True)
    ids = [3, 60, 7, 21, 0, 9, 44, 13]
    stream.follow_compute()
    stream.run(lambda: source.gather(source.layers[0], ids, rows, len(ids)))
    gathered = stream.record()
    gathered.synchronize()
    stream.run(lambda: destination.scatter(destination.layers[0], ids, rows, len(ids)))
    stream.make_compute_wait(stream.record())
    index = torch.tensor(ids, device=device)
    assert torch.equal(target.index_select(0, index), kv.index_select(0, index))
