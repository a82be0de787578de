"""Persisting a snapshot to storage with DCP, from the staged copy rather than the model.

A DCP save planner whose local plan is the snapshot's layout (the WriteItems DCP's default
planner produced when the layout was built) and whose data comes from the snapshot's
buffer: the storage checkpoint it writes is the one `dcp.save` of the live state would
have written, byte for byte in its metadata, and loads with any DCP reader.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from stalwart.checkpointing.snapshot import Shard


class SnapshotSavePlanner(DefaultSavePlanner):
    def __init__(self, shard: Shard) -> None:
        super().__init__()
        self.shard = shard

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.mappings = dict(self.shard.layout.planner_data)
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(list(self.shard.layout.items), planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.shard.values[write_item.index.fqn], buf)
            buf.seek(0)
            return buf
        return self.shard.tensor(write_item.index)
