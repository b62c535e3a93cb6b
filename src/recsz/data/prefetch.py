"""Batches made ahead of the step that uses them, by a background thread, and moved to the
device on a side stream (``--prefetch``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

from recsz.data.source import Batch, DataSource, Part


def prefetch(
    source: DataSource,
    steps: range,
    batch_size: int,
    device: torch.device,
    depth: int = 2,
    part: Part | None = None,
) -> Iterator[Batch]:
    """The training batches of ``steps`` (``part`` of each), made ``depth`` ahead by a
    background thread, so that reading and parsing overlap training. For a CUDA device
    each batch is pinned and copied on a side stream, and handed over after that copy is
    ordered before the consumer's work (and its memory marked as used by the consumer's
    stream: the host may run steps ahead of the GPU, and the thread's next copies must not
    land in it early).
    An error in the thread is raised to the consumer; leaving the loop early stops the
    thread. ``depth`` 0 makes each batch when it is asked for, no thread."""
    if depth == 0:
        for step in steps:
            yield source.train_batch(step, batch_size, part).to(device)
        return
    q: queue.Queue[tuple[Batch | None, BaseException | None]] = queue.Queue(depth)
    stop = threading.Event()
    cuda = device.type == "cuda"

    def put(item: tuple[Batch | None, BaseException | None]) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        stream = torch.cuda.Stream(device) if cuda else None
        try:
            for step in steps:
                batch = source.train_batch(step, batch_size, part)
                if stream is not None:
                    with torch.cuda.stream(stream):
                        batch = batch.pin_memory().to(device)
                    stream.synchronize()
                if not put((batch, None)):
                    return
        except BaseException as e:  # handed to the consumer, which raises it
            put((None, e))

    thread = threading.Thread(target=work, name="recsz-prefetch", daemon=True)
    thread.start()
    try:
        for _ in steps:
            batch, err = q.get()
            if err is not None:
                raise err
            assert batch is not None
            if cuda:  # its memory came from the side stream's pool: not to be reused there
                for t in (batch.dense, batch.ids, batch.labels):  # before this stream is done
                    t.record_stream(torch.cuda.current_stream(device))
            yield batch.to(device)
    finally:
        stop.set()
        thread.join(timeout=5)
