"""Documents to rows of exactly seq_len tokens: input ids, labels and position ids.

Three modes:
- "concat" (continued pre-training on text): the documents one after the other, cut every
  seq_len tokens; a document crossing a row's end continues at the start of the next row.
- "pack" (instruction data): whole documents, greedily in order; one that does not fit in the
  row's space left starts the next row; one longer than seq_len is cut to seq_len.
- "pad": one document per row, cut to seq_len.
A row's unused end is padding. The same documents always give the same rows.

Labels follow Hugging Face's convention: the model shifts them itself, so `labels[t]` is the
token that the logits at t-1 are trained to predict. It is `input_ids[t]` where the loss mask
is true and -100 (ignored) elsewhere: on padding, and on the first token of every document in
a row, which must not be predicted from the end of the previous document.

Attention that does not cross documents comes from the position ids alone. Each document's
positions restart at 0 in its row, and so do the padding's (0, 1, 2, ...: a document of its own).
Hugging Face models in transformers 5 (`transformers.masking_utils.create_causal_mask`) read a
row whose position ids restart as several packed sequences (`find_packed_sequence_indices`) and
build a block-diagonal causal mask (checked here for the sdpa and eager implementations).
They do so only when the forward gets no `attention_mask` and no KV cache: the batch carries no
attention mask, and the forward must be called with `use_cache=False`, since a model whose
config says `use_cache=True` otherwise makes itself an empty cache and falls back to one causal
mask over the whole row. tests/unit/test_packing_attention.py checks that a packed row's logits
equal those of each document run alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from stalwart.core.errors import TaskError

MODES = ("concat", "pack", "pad")
IGNORE = -100  # the label Hugging Face's cross-entropy skips


@dataclass
class PackStats:
    """What packing did: documents in, rows out, documents cut, real tokens, tokens with loss.

    `dropped` counts documents left out because no token of theirs carried the loss after
    truncation (a prompt longer than the row): they would cost compute and teach nothing."""

    docs: int = 0
    rows: int = 0
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    loss_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"docs": self.docs, "rows": self.rows, "truncated": self.truncated,
                "dropped": self.dropped, "tokens": self.tokens, "loss_tokens": self.loss_tokens}


@dataclass
class PackedArrays:
    """Packed rows: three int32 arrays [rows, seq_len] and the stats of the packing."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    stats: PackStats = field(default_factory=PackStats)

    @property
    def docs(self) -> int:
        return self.stats.docs

    @property
    def rows(self) -> int:
        return self.stats.rows

    @property
    def truncated(self) -> int:
        return self.stats.truncated

    @property
    def tokens(self) -> int:
        return self.stats.tokens

    @property
    def loss_tokens(self) -> int:
        return self.stats.loss_tokens


# One packed row: input_ids, labels, position_ids, each int32 [seq_len].
PackedRow = tuple[np.ndarray, np.ndarray, np.ndarray]


class Packer:
    """Packs documents as they come (`add`), handing back each row as soon as it is full, so a
    data set streams to disk without being held in memory; `finish` pads the last row."""

    def __init__(self, seq_len: int, *, pad_id: int, mode: str) -> None:
        if mode not in MODES:
            raise TaskError(f"packing mode {mode!r} is not one of {', '.join(MODES)}")
        if seq_len < 2:
            raise TaskError(f"seq_len = {seq_len} is too short to pack; give at least 2 tokens")
        self.seq_len, self.pad_id, self.mode = seq_len, pad_id, mode
        self.stats = PackStats()
        self._row = self._empty()
        self._fill = 0

    def _empty(self) -> PackedRow:
        n = self.seq_len
        return (np.full(n, self.pad_id, np.int32), np.full(n, IGNORE, np.int32),
                np.zeros(n, np.int32))

    def add(self, ids: Sequence[int], mask: Sequence[bool]) -> list[PackedRow]:
        """Add one document; returns the rows it completed (often none)."""
        if len(ids) != len(mask):
            raise ValueError(f"a document has {len(ids)} ids but {len(mask)} mask values")
        if not len(ids):
            return []
        self.stats.docs += 1
        ids_a = np.asarray(ids, dtype=np.int32)
        labels = np.where(np.asarray(mask, dtype=bool), ids_a, IGNORE).astype(np.int32)
        if self.mode == "concat":
            return self._add_concat(ids_a, labels)
        if len(ids_a) > self.seq_len:
            self.stats.truncated += 1
            ids_a, labels = ids_a[: self.seq_len], labels[: self.seq_len]
        if not (labels[1:] != IGNORE).any():  # the first token's label is dropped below
            self.stats.dropped += 1
            return []
        done = []
        if self.mode == "pad" or self._fill + len(ids_a) > self.seq_len:
            done += self._flush()
        self._place(ids_a, labels)
        if self.mode == "pad" or self._fill == self.seq_len:
            done += self._flush()
        return done

    def _add_concat(self, ids: np.ndarray, labels: np.ndarray) -> list[PackedRow]:
        done = []
        while len(ids):
            take = self.seq_len - self._fill
            self._place(ids[:take], labels[:take])
            ids, labels = ids[take:], labels[take:]
            if self._fill == self.seq_len:
                done += self._flush()
        return done

    def _place(self, ids: np.ndarray, labels: np.ndarray) -> None:
        start, end = self._fill, self._fill + len(ids)
        row_ids, row_labels, row_pos = self._row
        row_ids[start:end] = ids
        row_labels[start:end] = labels
        row_labels[start] = IGNORE  # never predict a document from the one before it
        row_pos[start:end] = np.arange(len(ids), dtype=np.int32)
        self._fill = end
        self.stats.tokens += len(ids)

    def _flush(self) -> list[PackedRow]:
        if not self._fill:
            return []
        row_ids, row_labels, row_pos = self._row
        # Padding is a document of its own: positions from 0, so attention keeps it apart.
        row_pos[self._fill:] = np.arange(self.seq_len - self._fill, dtype=np.int32)
        self.stats.rows += 1
        self.stats.loss_tokens += int((row_labels != IGNORE).sum())
        done = self._row
        self._row, self._fill = self._empty(), 0
        return [done]

    def finish(self) -> list[PackedRow]:
        """Pad and hand back the last, partly filled row, if any."""
        return self._flush()


def pack(docs: Iterable[tuple[Sequence[int], Sequence[bool]]], seq_len: int, *, pad_id: int,
         mode: str) -> PackedArrays:
    """Pack `docs` (ids and loss mask per document) into rows of seq_len tokens, in memory."""
    packer = Packer(seq_len, pad_id=pad_id, mode=mode)
    rows = list(_rows(packer, docs))
    if rows:
        input_ids, labels, position_ids = (np.stack(a) for a in zip(*rows, strict=True))
    else:
        input_ids = labels = position_ids = np.zeros((0, seq_len), np.int32)
    return PackedArrays(input_ids, labels, position_ids, packer.stats)


def _rows(packer: Packer, docs: Iterable[tuple[Sequence[int], Sequence[bool]]]
          ) -> Iterator[PackedRow]:
    for ids, mask in docs:
        yield from packer.add(ids, mask)
    yield from packer.finish()
