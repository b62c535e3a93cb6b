"""Batches made ahead of the step that uses them, by a background thread, and moved to the
device on a side stream (``--prefetch``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

import torch

from recsz.data.source import Batch


def prefetch(batches: Iterable[Batch], device: torch.device, depth: int = 2) -> Iterator[Batch]:
    """``batches`` (an iterable that makes each when asked: e.g. the training batches of
    some steps, or the evaluation set's), made ``depth`` ahead by a background thread, so
    that reading and parsing overlap training. For a CUDA device each batch is pinned and
    copied on a side stream, and handed over after that copy is ordered before the
    consumer's work (and its memory marked as used by the consumer's stream: the host may
    run steps ahead of the GPU, and the thread's next copies must not land in it early).
    An error in the thread is raised to the consumer; leaving the loop early stops the
    thread. ``depth`` 0 makes each batch when it is asked for, no thread."""
    if depth == 0:
        for batch in batches:
            yield batch.to(device)
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
            for made in batches:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        made = made.pin_memory().to(device)
                    stream.synchronize()
                if not put((made, None)):
                    return
            put((None, None))  # the end
        except BaseException as e:  # handed to the consumer, which raises it
            put((None, e))

    thread = threading.Thread(target=work, name="recsz-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            got, err = q.get()
            if err is not None:
                raise err
            if got is None:
                return
            if cuda:  # its memory came from the side stream's pool: not to be reused there
                for t in (got.dense, got.ids, got.labels):  # before this stream is done
                    t.record_stream(torch.cuda.current_stream(device))
            yield got.to(device)
    finally:
        stop.set()
        thread.join(timeout=5)
