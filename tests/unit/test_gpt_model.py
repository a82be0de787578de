"""Unit tests for the example GPT model: shapes, weight tying, meta init, causality, learning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stalwart.examples.gpt.model import GPT, GPTConfig

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TINY = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _model(seed: int = 0, cfg: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def test_forward_shape_and_dtype() -> None:
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    logits = model(tokens)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    assert logits.dtype == torch.float32
    # Shorter sequences use a prefix of the rotary tables.
    assert model(tokens[:, :5]).shape == (3, 5, TINY.vocab_size)


def test_too_long_sequence_is_rejected() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        _model()(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))


def test_output_is_tied_to_embedding_after_init_weights() -> None:
    model = _model()
    assert model.output.weight is model.tok_embeddings.weight
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    names = [n for n, _ in model.named_parameters()]
    assert "output.weight" not in names  # deduplicated: only one copy is trained
    assert model.num_params() == sum(p.numel() for p in set(model.parameters()))


def test_module_names_for_tensor_parallel_plans() -> None:
    names = dict(_model().named_modules())
    for suffix in (
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
        "attention_norm",
        "ffn_norm",
    ):
        assert f"layers.0.{suffix}" in names
    assert names["layers.0.feed_forward.w1"].out_features == 96  # multiple of 32 of int(8*32/3)=85


def test_meta_init_matches_normal_init_bitwise() -> None:
    with torch.device("meta"):
        meta = GPT(TINY)
    assert meta.tok_embeddings.weight.is_meta
    meta.to_empty(device="cpu")
    assert meta.output.weight is meta.tok_embeddings.weight  # to_empty must not untie
    torch.manual_seed(123)
    meta.init_weights()

    normal = _model(seed=7)
    torch.manual_seed(123)
    normal.init_weights()

    assert meta.output.weight is meta.tok_embeddings.weight
    for (name, a), (_, b) in zip(meta.named_parameters(), normal.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(meta.named_buffers(), normal.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    assert torch.equal(meta(tokens), normal(tokens))


def test_residual_projections_use_smaller_init() -> None:
    model = _model(cfg=GPTConfig(d_model=64, n_layers=8, n_heads=4, seq_len=8))
    wq_std = model.layers[0].attention.wq.weight.std().item()
    wo_std = model.layers[0].attention.wo.weight.std().item()
    assert wq_std == pytest.approx(0.02, rel=0.1)
    assert wo_std == pytest.approx(0.02 / 4, rel=0.1)  # sqrt(2 * 8) = 4


def test_attention_is_causal() -> None:
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_adamw_overfits_one_batch() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len + 1), generator=gen)
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"seq_len": -1}, "seq_len"),
        ({"d_model": 30, "n_heads": 4}, "n_heads"),  # does not divide
        ({"d_model": 12, "n_heads": 4}, "n_heads"),  # odd head_dim
        ({"n_layers": 0}, "n_layers"),
        ({"ffn_hidden": -1}, "ffn_hidden"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"norm_eps": -1e-5}, "norm_eps"),
        ({"init_std": 0.0}, "init_std"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**kwargs)


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = GPTConfig()
    assert cfg.ffn_dim == 352 and cfg.head_dim == 32
    with pytest.raises(AttributeError):
        cfg.d_model = 64  # type: ignore[misc]
    with pytest.raises(TypeError):
        GPTConfig(256)  # type: ignore[misc]
