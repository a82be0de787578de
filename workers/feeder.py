"""The rank's batches for the steps ahead, read on a background thread.

A step's data is a pure function of its first global position (samples_seen), so the feeder
reads step k + 1 (and further, up to `depth` steps) while step k trains. A restore or a new
world only moves the position: whatever was read ahead for another position is dropped.
Reading, decoding and a stream's transform all run on the thread; moving to the device does
not (the step's own thread owns the device).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from stalwart.core.batch import Batch
from stalwart.core.stream import SampleIds, StreamDataset
from stalwart.workers.sampler import GlobalSampler, rank_slice


@dataclass(frozen=True)
class StepData:
    batches: list[Batch]
    """One per range of the step's plan (micro-batches, or the pipeline's whole slice)."""
    ids: SampleIds
    """Every sample of the step on this rank, in batch order."""


def step_ranges(position: int, *, global_batch: int, dp_rank: int, dp_size: int,
                micro_batch: int, micro_batches: int) -> list[tuple[int, int]]:
    """The global sample ranges a data-parallel rank reads for the step starting at
    `position`: one per micro-batch, or its whole slice in one (a pipeline's schedule splits
    it itself)."""
    start, count = rank_slice(position, global_batch, dp_rank, dp_size)
    if micro_batches == 1:
        return [(start, count)]
    return [(start + i * micro_batch, micro_batch) for i in range(micro_batches)]


def bind_dataset(data: Any, *, seed: int, global_batch: int, cache_dir: str) -> None:
    """Fix a stream's order before the first read (map-style datasets need nothing)."""
    if isinstance(data, StreamDataset):
        data.bind(seed=seed, global_batch=global_batch, cache_dir=cache_dir)


class Feeder:
    """Reads `plan(position)`'s ranges of `data` ahead of the step that needs them."""

    def __init__(self, data: Any, *, seed: int, plan: Callable[[int], list[tuple[int, int]]],
                 step_size: int, depth: int) -> None:
        self.data = data
        self.stream = isinstance(data, StreamDataset)
        self.sampler = None if self.stream else GlobalSampler(len(data), seed=seed)
        self.plan, self.step_size, self.depth = plan, step_size, depth
        self._ahead: deque[tuple[int, Future[StepData]]] = deque()
        # One thread: steps are read in order, and a task's own dataset need not be safe on
        # two (a stream reads its units on threads of its own).
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="stalwart-data")
                      if depth > 0 else None)
        self.waiting = False
        """True while the step's thread waits for data: slow work, not a hang (the worker
        reports it busy, which lengthens the controller's hang limit)."""

    def take(self, position: int) -> tuple[StepData, float]:
        """The step at `position`, and the seconds this call waited for it."""
        t0 = time.perf_counter()
        self.waiting = True
        try:
            if self._pool is None:
                return self.load(position), time.perf_counter() - t0
            if not self._ahead or self._ahead[0][0] != position:
                self._drop()
            self._fill(position)
            _, future = self._ahead.popleft()
            data = future.result()
        finally:
            self.waiting = False
        waited = time.perf_counter() - t0
        self._fill(position + self.step_size)
        return data, waited

    def check_ahead(self, position: int) -> tuple[str | None, float]:
        """Wait for the step at `position` and return the error reading it met (None if it
        read), with the seconds waited: a rank that cannot read its next step tells its
        peers in this step's all-reduce, so that all stop after this step, checkpointed."""
        if self._pool is None:
            return None, 0.0
        t0 = time.perf_counter()
        if self._ahead and self._ahead[0][0] != position:
            self._drop()
        self._fill(position)
        self.waiting = True
        try:
            error = self._ahead[0][1].exception()
        finally:
            self.waiting = False
        waited = time.perf_counter() - t0
        return (None if error is None else f"{type(error).__name__}: {error}"), waited

    def load(self, position: int) -> StepData:
        batches, ids = [], []
        for start, count in self.plan(position):
            if self.stream:
                batch, sample_ids = self.data.read(start, count)
            else:
                assert self.sampler is not None
                items = self.sampler.items(start, count)
                batch = self.data.get_batch(items)
                n = self.sampler.num_items
                sample_ids = SampleIds(epoch=np.arange(start, start + count) // n,
                                       file=np.zeros(count, dtype=np.int64), row=items,
                                       files=("",))
            batches.append(batch)
            ids.append(sample_ids)
        return StepData(batches, _concat(ids))

    def _fill(self, position: int) -> None:
        assert self._pool is not None
        next_position = self._ahead[-1][0] + self.step_size if self._ahead else position
        while len(self._ahead) < self.depth:
            self._ahead.append((next_position, self._pool.submit(self.load, next_position)))
            next_position += self.step_size

    def _drop(self) -> None:
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()

    def close(self) -> None:
        self._drop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _concat(parts: list[SampleIds]) -> SampleIds:
    if len(parts) == 1:
        return parts[0]
    return SampleIds(epoch=np.concatenate([p.epoch for p in parts]),
                     file=np.concatenate([p.file for p in parts]),
                     row=np.concatenate([p.row for p in parts]), files=parts[0].files)
