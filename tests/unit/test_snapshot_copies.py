"""The copies a snapshot's bytes are spared: a slot's tensor owns exactly its bytes (DCP's
writer clones any tensor whose storage is larger than it), a holder's export is a view of
its buffer (Ray makes the one copy), and the CRC32 of a buffer's parts, computed at once,
combines to the CRC32 of the whole. Figures are bench/limits.py's; here only what each
returns."""

from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest
import torch

from stalwart.checkpointing.memory.tier import MemoryTier
from stalwart.checkpointing.snapshot import (
    CRC_PART_MIN,
    SnapshotStager,
    buffer_crc,
    crc32_combine,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _shard(step: int = 3):  # noqa: ANN202
    state = {"model": {"w": torch.randn(5, 7), "b": torch.arange(3, dtype=torch.bfloat16),
                       "empty": torch.zeros(0, 4)}, "train": {"step": step}}
    stager = SnapshotStager(state_dict=lambda: state,
                            scalar_state=lambda: {"train": {"step": step}},
                            signature=lambda: 0, device=torch.device("cpu"))
    shard = stager.stage(step)
    shard.seal()
    return shard, state


def test_a_slots_tensor_owns_exactly_its_bytes_of_the_buffer() -> None:
    shard, state = _shard()
    buffer = shard.buffer.numpy()
    for index, slot in shard.layout.slots.items():
        t = shard.tensor(index)
        assert t.untyped_storage().nbytes() == t.nbytes == slot.nbytes
        assert (t.dtype, tuple(t.shape)) == (slot.dtype, slot.shape)
        if slot.nbytes:  # the buffer's own memory, not a copy of it
            assert t.data_ptr() == buffer.ctypes.data + slot.offset
        assert torch.equal(t, state["model"][index.fqn.removeprefix("model.")])


def test_an_export_is_a_view_of_the_held_buffer_with_its_values_and_crc() -> None:
    shard, _ = _shard(step=4)
    tier = MemoryTier()
    tier.store.put(0, 2, shard)
    array, values, crc = tier.export(0, 2, 4)
    assert np.shares_memory(array, shard.buffer.numpy())
    assert (values, crc) == (shard.values, shard.crc)
    with pytest.raises(LookupError, match="no snapshot of rank 2 of generation 0 at step 5"):
        tier.export(0, 2, 5)


def test_crc32_combine_joins_two_crcs_as_zlib_would() -> None:
    rng = random.Random(7)
    for _ in range(200):
        a, b = os.urandom(rng.randrange(0, 2000)), os.urandom(rng.randrange(0, 2000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_a_buffers_crc_is_the_same_on_any_number_of_threads(threads: int) -> None:
    # Three parts' worth and an odd tail: unequal parts, every byte in exactly one.
    data = torch.randint(0, 256, (3 * CRC_PART_MIN + 12345,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(threads))
    assert buffer_crc(data, threads) == zlib.crc32(data.numpy())
    assert buffer_crc(torch.zeros(0, dtype=torch.uint8), threads) == 0
