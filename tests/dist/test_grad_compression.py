"""Gradient compression trains close to exact reduction, and PowerSGD's state is what makes
its resume exact: without it the continued run takes another path."""

from __future__ import annotations

import pytest
import torch

from tests.dist.launcher import run_ranks
from tests.dist.test_checkpoint_reshard import (
    POWERSGD,
    SAVE_AT,
    full_weights,
    make_engine,
    save_then_continue,
)
from tests.dist.test_data_parallel import (  # noqa: F401 (fixtures)
    cache_dir,
    single_process,
    single_process_losses,
    train_losses,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

DDP2 = ["parallel.dp_replicate=2", "parallel.dp_shard=1"]


@pytest.mark.parametrize(("layout", "rel"), [
    # Half-precision sums: each gradient rounded to 8 (bf16) or 11 (fp16) bits of mantissa.
    pytest.param([*DDP2, "parallel.grad_compression=bf16"], 1e-4, id="ddp2-bf16"),
    pytest.param([*DDP2, "parallel.grad_compression=fp16"], 1e-4, id="ddp2-fp16"),
    pytest.param(["parallel.dp_shard=2", "parallel.grad_compression=bf16"], 1e-4,
                 id="fsdp2-bf16-reduce"),
    # Rank-4 factors from step 3 on, the rest carried by error feedback.
    pytest.param(POWERSGD, 2e-3, id="ddp2-powersgd"),
])
def test_compressed_reduction_trains_close_to_exact(cache_dir, single_process_losses,  # noqa: F811
                                                    layout, rel):
    losses = run_ranks(train_losses, 2, cache_dir, layout)[0]
    assert losses == pytest.approx(single_process_losses, rel=rel)
    assert losses != single_process_losses  # it did compress


def load_without_powersgd_state(rank, world, cache, layout, storage):
    """As load_then_continue, but the PowerSGD state keeps its fresh values."""
    from stalwart.checkpointing.storage.catalog import read_step_dir
    from stalwart.checkpointing.storage.layout import join, step_dir_name
    from stalwart.checkpointing.storage.writer import StorageCheckpointer
    from tests.keys import trust

    engine = make_engine(rank, world, cache, layout)
    ckpt = StorageCheckpointer(storage, rank=rank, keep_last=0, async_save=False,
                               manifest_extra={}, trust=trust())
    state = engine.state_dict()
    fresh = state.pop("comm")
    path = join(storage, step_dir_name(SAVE_AT))
    ckpt.load(path, read_step_dir(path).manifest["files"], state)
    engine.load_state_dict({**state, "comm": fresh})
    ckpt.close()
    return full_weights(engine), [engine.train_step()[0].loss for _ in range(3)]


def test_a_resume_without_the_powersgd_state_diverges(tmp_path, cache_dir):  # noqa: F811
    storage = str(tmp_path / "ckpt")
    saved = run_ranks(save_then_continue, 2, cache_dir, POWERSGD, storage)
    bare = run_ranks(load_without_powersgd_state, 2, cache_dir, POWERSGD, storage)
    for key, value in saved[0][0].items():  # the weights at the save are the same
        assert torch.equal(value, bare[0][0][key])
    assert bare[0][1] != saved[0][1]  # the control: the state is what makes the resume exact
