"""Packed rows attend within each document: the position ids alone separate them.

A tiny Llama from transformers runs one packed row (stalwart.data.packing) of three documents
and padding. Its logits on each document equal those of the document run alone, for sdpa and
eager attention. Two controls show the test can fail: the same row without the position ids
that restart per document, and the same call with the model's default KV cache.
"""

from __future__ import annotations

import pytest
import torch

from stalwart.data.packing import pack

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LENGTHS = (5, 7, 4)
SEQ_LEN = 19  # 16 tokens of documents and 3 of padding


def _model(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
                         max_position_embeddings=64, attn_implementation=attn)
    return LlamaForCausalLM(config).float().eval()


def _docs() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (n,), generator=g).tolist() for n in LENGTHS]


def _packed_row(docs: list[list[int]]) -> dict[str, torch.Tensor]:
    packed = pack([(d, [True] * len(d)) for d in docs], SEQ_LEN, pad_id=0, mode="pack")
    assert packed.rows == 1
    return {name: torch.from_numpy(getattr(packed, name)).long()
            for name in ("input_ids", "labels", "position_ids")}


def _per_document(logits: torch.Tensor) -> list[torch.Tensor]:
    out, start = [], 0
    for n in LENGTHS:
        out.append(logits[start:start + n])
        start += n
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_matches_each_document_alone(attn: str) -> None:
    model, docs = _model(attn), _docs()
    row = _packed_row(docs)
    with torch.no_grad():
        packed = model(input_ids=row["input_ids"], position_ids=row["position_ids"],
                       use_cache=False).logits[0]
        alone = [model(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in docs]
        # Controls: one position range over the whole row, or the default cache, and the
        # documents see each other.
        flat = model(input_ids=row["input_ids"], use_cache=False).logits[0]
        cached = model(input_ids=row["input_ids"], position_ids=row["position_ids"]).logits[0]
    for got, want in zip(_per_document(packed), alone, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for control in (flat, cached):
        later = _per_document(control)[1:]
        assert any((got - want).abs().max() > 1e-3 for got, want in zip(later, alone[1:],
                                                                           strict=True))


def test_packed_labels_give_the_sum_of_per_document_losses() -> None:
    model, docs = _model("sdpa"), _docs()
    row = _packed_row(docs)
    with torch.no_grad():
        logits = model(input_ids=row["input_ids"], position_ids=row["position_ids"],
                       use_cache=False).logits[0]
        alone = [model(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in docs]
    # Hugging Face's shift: labels[t] is predicted from logits[t - 1].
    packed_sum = torch.nn.functional.cross_entropy(logits[:-1], row["labels"][0, 1:],
                                                   ignore_index=-100, reduction="sum")
    alone_sum = sum(torch.nn.functional.cross_entropy(a[:-1], torch.tensor(d[1:]),
                                                      reduction="sum")
                    for a, d in zip(alone, docs, strict=True))
    assert int((row["labels"] != -100).sum()) == sum(n - 1 for n in LENGTHS)
    torch.testing.assert_close(packed_sum, alone_sum, atol=1e-4, rtol=1e-5)
