"""Which step the memory tier can restore: the newest one complete across the live holders.

Pure bookkeeping on the driver, from each live worker's inventory. A step is complete when
every tensor of the state is covered by chunks that some live worker holds at that step,
and every value is held: a data-parallel replica holds everything, a sharded layout needs
every shard (or its replica). The names of the state come from every layout seen for the
generation and from the names every rank shared when its world formed, so a shard whose
holders are all gone is still known to be missing, even when no other shard has its names
(a pipeline stage).

Only honest parts count: a layout held for a source rank that claims chunks (or values)
which another rank of its world declared as its own when the world formed, and the source
did not, is left out (with its reason), whoever holds it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from torch.distributed.checkpoint.planner import WriteItemType

from stalwart.checkpointing.memory.store import Claim, Inventory
from stalwart.checkpointing.memory.wire import claims
from stalwart.checkpointing.snapshot import ShardLayout


@dataclass(frozen=True)
class MemoryChoice:
    generation: int
    step: int
    layouts: dict[int, ShardLayout]
    """ShardLayout of each source rank's shard held at this step."""
    holders: dict[int, list[str]]
    """Source rank -> keys of the live workers holding its shard at this step."""


def _missing(layouts: dict[int, ShardLayout], known: dict[str, int | None]) -> list[str]:
    """Names (of `known`: name -> numel, None for a value, -1 for a name of unknown kind)
    that `layouts` do not cover."""
    chunks: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = defaultdict(set)
    values: set[str] = set()
    for layout in layouts.values():
        for item in layout.items:
            if item.type == WriteItemType.BYTE_IO:
                values.add(item.index.fqn)
            else:
                c = item.tensor_data.chunk
                chunks[item.index.fqn].add((tuple(c.offsets), tuple(c.sizes)))
    missing = []
    for name, numel in sorted(known.items()):
        if numel == -1:
            if name not in values and name not in chunks:
                missing.append(name)
        elif numel is None:
            if name not in values:
                missing.append(name)
        elif sum(math.prod(sizes) for _, sizes in chunks.get(name, ())) < numel:
            missing.append(name)
    return missing


def foreign_claims(source: int, layout_claims: frozenset[Claim],
                   declared: dict[int, frozenset[Claim]]) -> list[Claim]:
    """What a layout of `source`'s shard claims that other ranks declared and `source` did not
    (empty when nothing was declared: a world that never shared its claims)."""
    if not declared:
        return []
    own = declared.get(source, frozenset())
    others: set[Claim] = set()
    for rank, cs in declared.items():
        if rank != source:
            others |= cs
    return sorted((c for c in layout_claims - own if c in others),
                  key=lambda c: (c[0], c[1] or ()))


def describe(claims: list[Claim], limit: int = 3) -> str:
    shown = ", ".join(name + ("" if off is None else str(list(off))) for name, off in
                      claims[:limit])
    return shown + (f" and {len(claims) - limit} more" if len(claims) > limit else "")


def newest_complete(inventories: dict[str, Inventory]) -> tuple[MemoryChoice | None, str]:
    """The newest complete (generation, step), or None and why the newest one held is not."""
    held: dict[tuple[int, int], dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    layout_of: dict[tuple[int, int, int], ShardLayout] = {}
    known: dict[int, dict[str, int | None]] = defaultdict(dict)
    declared: dict[int, dict[int, frozenset[Claim]]] = {}
    for inv in inventories.values():  # every rank of a world received the same claims
        for gen, by_rank in inv.claims.items():
            declared.setdefault(gen, dict(by_rank))
    dishonest: list[str] = []
    for worker, inv in inventories.items():
        for h in inv.holdings:
            layout = inv.layouts[h.layout_key]
            foreign = foreign_claims(h.source, claims(layout),
                                     declared.get(h.generation, {}))
            if foreign:  # not counted: completeness comes from honest parts only
                dishonest.append(f"{worker}'s copy of rank {h.source}'s step {h.step} claims "
                                 f"chunks of other ranks ({describe(foreign)})")
                continue
            held[(h.generation, h.step)][h.source].append(worker)
            layout_of[(h.generation, h.step, h.source)] = layout
            for item in layout.items:
                known[h.generation][item.index.fqn] = (
                    None if item.type == WriteItemType.BYTE_IO
                    else math.prod(item.tensor_data.size))
        for gen, names in inv.names.items():
            for name in names:
                known[gen].setdefault(name, -1)
    refused = f"; left out: {'; '.join(dishonest)}" if dishonest else ""
    if not held:
        return None, "no snapshot is held in memory" + refused
    first_reason = ""
    # Newest step first; of equal steps, the newer generation.
    for gen, step in sorted(held, key=lambda k: (k[1], k[0]), reverse=True):
        sources = held[(gen, step)]
        layouts = {src: layout_of[(gen, step, src)] for src in sources}
        missing = _missing(layouts, known[gen])
        if not missing:
            return MemoryChoice(generation=gen, step=step, layouts=layouts,
                                holders={s: sorted(w) for s, w in sources.items()}
                                ), (first_reason + refused).removeprefix("; ")
        if not first_reason:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more"
                                               if len(missing) > 3 else "")
            first_reason = (f"step {step} is not complete in memory (held for source ranks "
                            f"{sorted(sources)}; no live copy of {shown})")
    return None, first_reason + refused
