"""The memory tier on one worker: its own snapshots and the replicas it holds for peers.

Keyed by (generation, source rank): a rank's number means something only within its
generation's world. It lives on the worker actor, not on the engine, so it survives the
worker leaving a world: after a failure the survivors still hold their own shards and their
peers' replicas, and the next world restores from them.

At most `keep` snapshots are kept per source (two by default: the newest complete one and
the one being written); a buffer about to be overwritten is dropped from the store first, so
the store never lists a snapshot that is half written.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stalwart.checkpointing.snapshot import Shard, ShardLayout

Claim = tuple[str, tuple[int, ...] | None]
"""(name, chunk offsets) of a tensor chunk a shard holds, (name, None) of a value."""

KEEP = 2


@dataclass(frozen=True)
class Holding:
    """One snapshot this worker can serve: (generation, source rank, step) and its layout."""

    generation: int
    source: int
    step: int
    layout_key: str


@dataclass(frozen=True)
class Inventory:
    holdings: tuple[Holding, ...]
    layouts: dict[str, ShardLayout]
    nbytes: int
    names: dict[int, frozenset[str]] = field(default_factory=dict)
    """Per generation, the names in every rank's shard (when the world shared them)."""
    claims: dict[int, dict[int, frozenset[Claim]]] = field(default_factory=dict)
    """Per generation, what each rank declared its shard holds when the world formed."""


class MemoryStore:
    def __init__(self) -> None:
        self.keep = KEEP
        self._shards: dict[tuple[int, int], list[Shard]] = {}
        self._claims: dict[int, dict[int, frozenset[Claim]]] = {}
        self._lock = threading.Lock()

    def set_claims(self, generation: int, claims: dict[int, frozenset[Claim]]) -> None:
        """What each rank of `generation`'s world declared its shard holds."""
        with self._lock:
            self._claims[generation] = dict(claims)

    def claims(self, generation: int) -> dict[int, frozenset[Claim]]:
        with self._lock:
            return dict(self._claims.get(generation, {}))

    def put(self, generation: int, source: int, shard: Shard) -> None:
        """Record a complete snapshot; the oldest beyond `keep` is forgotten."""
        with self._lock:
            shards = [s for s in self._shards.get((generation, source), [])
                      if s.step != shard.step and s.buffer is not shard.buffer]
            shards.append(shard)
            shards.sort(key=lambda s: s.step)
            self._shards[(generation, source)] = shards[-self.keep:]

    def forget_buffer(self, buffer: torch.Tensor) -> None:
        """Forget the snapshot in `buffer`: it is about to be overwritten."""
        with self._lock:
            for key, shards in self._shards.items():
                self._shards[key] = [s for s in shards if s.buffer is not buffer]

    def reusable_buffer(self, generation: int, source: int, nbytes: int) -> torch.Tensor | None:
        """The oldest buffer held for this source when `keep` are held (to receive the next
        snapshot into), forgotten first; None when a new buffer is needed."""
        with self._lock:
            shards = self._shards.get((generation, source), [])
            if len(shards) < self.keep or shards[0].buffer.numel() != nbytes:
                return None
            oldest = shards.pop(0)
            return oldest.buffer

    def get(self, generation: int, source: int, step: int) -> Shard | None:
        with self._lock:
            for s in self._shards.get((generation, source), []):
                if s.step == step:
                    return s
        return None

    def inventory(self) -> Inventory:
        with self._lock:
            holdings, layouts = [], {}
            for (gen, src), shards in sorted(self._shards.items()):
                for s in shards:
                    if s.crc is None:
                        continue  # not sealed yet (its exchange has not started): not served
                    holdings.append(Holding(gen, src, s.step, s.layout.key))
                    layouts[s.layout.key] = s.layout
            gens = {h.generation for h in holdings}
            return Inventory(
                holdings=tuple(holdings), layouts=layouts, nbytes=self._nbytes(),
                names={g: frozenset(name for cs in c.values() for name, _ in cs)
                       for g, c in self._claims.items() if g in gens},
                claims={g: c for g, c in self._claims.items() if g in gens})

    def _nbytes(self, extra: Sequence[torch.Tensor] = ()) -> int:
        seen = {id(b): b.numel() for b in extra}
        for shards in self._shards.values():
            for s in shards:
                seen[id(s.buffer)] = s.buffer.numel()
        return sum(seen.values())

    def nbytes(self, extra: Sequence[torch.Tensor] = ()) -> int:
        """Bytes held, counting `extra` buffers (the stager's) once even if listed."""
        with self._lock:
            return self._nbytes(extra)

    def drop_before(self, generation: int) -> None:
        """Forget every snapshot of generations older than `generation`."""
        with self._lock:
            self._shards = {k: v for k, v in self._shards.items() if k[0] >= generation}
            self._claims = {g: c for g, c in self._claims.items() if g >= generation}

    def drop_after(self, generation: int, step: int) -> None:
        """Forget every snapshot of `generation` newer than `step` (a rollback's suspects)."""
        with self._lock:
            for key, shards in self._shards.items():
                if key[0] == generation:
                    self._shards[key] = [s for s in shards if s.step <= step]

    def clear(self) -> None:
        with self._lock:
            self._shards.clear()
            self._claims.clear()
