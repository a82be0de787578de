"""Unit tests for the fine-tuning data pipeline: rows, rendering, packing and the token cache.

The tokenizer is a real byte-level BPE trained here on a few sentences and saved with
save_pretrained, with a ChatML-like chat template: nothing is downloaded.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from stalwart.core.errors import TaskError
from stalwart.data import token_cache
from stalwart.data.packing import IGNORE, pack
from stalwart.data.render import check_tokenizer, render
from stalwart.data.rows import Row, data_files, read_rows, row_kind
from stalwart.data.token_cache import PackedRows, data_key, load_tokenizer, prepare, read_stats

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["hello world the cat sat on the mat", "what is two plus two it is four",
          "system user assistant you are helpful", "the quick brown fox jumps over the lazy dog",
          "café crème brûlée"]
CHAT = [{"role": "system", "content": "you are helpful"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "it is four"},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sat on the mat"}]


def _save_tokenizer(path: Path, chat_template: str | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # A BOS like Llama's: add_special_tokens=True puts <s> in front.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", chat_template=chat_template)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tokenizer(tmp_path_factory.mktemp("tok"), CHATML)


@pytest.fixture(scope="module")
def tok(tok_dir: Path):
    return load_tokenizer(str(tok_dir))


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(value: dict) -> Row:
    return Row("rows.jsonl", 1, value)


def _text(tok, ids: list[int], mask: list[bool]) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m])


# --- rendering ---------------------------------------------------------------------------------

def test_text_row_learns_every_token_and_the_eos(tok) -> None:
    ids, mask = render(tok, _row({"text": "hello world"}), "text")
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert ids == tok("hello world")["input_ids"] + [tok.eos_token_id]
    assert all(mask)


def test_prompt_is_context_and_completion_with_eos_is_learned(tok) -> None:
    ids, mask = render(tok, _row({"prompt": "what is two plus two", "completion": " four"}),
                       "prompt_completion")
    prompt = tok("what is two plus two")["input_ids"]
    assert ids[: len(prompt)] == prompt and prompt[0] == tok.bos_token_id
    assert mask == [False] * len(prompt) + [True] * (len(ids) - len(prompt))
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids[len(prompt):-1]) == " four"


def test_chat_loss_is_on_assistant_turns_with_their_end_of_turn(tok) -> None:
    row = _row({"messages": CHAT})
    assert row_kind(row) == "messages"
    ids, mask = render(tok, row, "messages")
    assert tok.decode(ids) == tok.apply_chat_template(CHAT, tokenize=False)
    assert _text(tok, ids, mask) == "it is four<|im_end|>\nsat on the mat<|im_end|>\n"
    # The assistant's header is prompt, not loss; its end-of-turn token is learned.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    learned_ends = [m for i, m in zip(ids, mask, strict=True) if i == im_end]
    assert learned_ends == [False, False, True, False, True]


def test_chat_with_non_ascii_content_masks_by_characters(tok) -> None:
    chat = [{"role": "user", "content": "café"}, {"role": "assistant", "content": "crème brûlée"}]
    ids, mask = render(tok, _row({"messages": chat}), "messages")
    assert _text(tok, ids, mask) == "crème brûlée<|im_end|>\n"


def test_missing_chat_template_names_the_tokenizer_and_the_way_out(tmp_path: Path) -> None:
    plain_dir = _save_tokenizer(tmp_path / "plain", chat_template=None)
    plain = load_tokenizer(str(plain_dir))
    with pytest.raises(TaskError, match="has no chat template") as e:
        check_tokenizer(plain, {"text", "messages"}, str(plain_dir))
    assert str(plain_dir) in str(e.value) and "prompt" in str(e.value)
    check_tokenizer(plain, {"text", "prompt_completion"}, str(plain_dir))
    with pytest.raises(TaskError, match="has no chat template"):
        render(plain, _row({"messages": CHAT}), "messages")


def test_unstable_chat_template_is_refused(tmp_path: Path) -> None:
    # A template that marks the last message differently: prefixes do not render stably.
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                "{% if loop.last %} [end]{% endif %}\n{% endfor %}")
    odd = load_tokenizer(str(_save_tokenizer(tmp_path / "odd", template)))
    with pytest.raises(TaskError, match="does not render prefixes stably"):
        render(odd, _row({"messages": CHAT}), "messages")


# --- rows --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "match"), [
    ({"question": "q", "answer": "a"}, "has keys answer, question"),
    ({"prompt": "only a prompt"}, "has keys prompt"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ([1, 2], "not an object"),
])
def test_bad_rows_name_the_row_and_the_allowed_shapes(value, match) -> None:
    with pytest.raises(TaskError, match=match) as e:
        row_kind(Row("data.jsonl", 7, value))
    assert "data.jsonl:7" in str(e.value)


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": oops}\n')
    with pytest.raises(TaskError, match=r"bad\.jsonl:3 is not valid JSON"):
        list(read_rows([str(path)]))


def test_no_files_matched_names_the_argument(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"task\.args\.data = .* matches no data file"):
        data_files(str(tmp_path / "nothing-*.jsonl"))
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(TaskError, match="suffix is not a data file's"):
        data_files(str(tmp_path / "table.csv"))


def test_jsonl_parquet_txt_directory_and_glob(tmp_path: Path) -> None:
    _jsonl(tmp_path / "b.jsonl", [{"text": "one"}, {"prompt": "p", "completion": "c"}])
    pq.write_table(pa.table({"messages": [CHAT, CHAT[1:3]]}), tmp_path / "a.parquet")
    (tmp_path / "c.txt").write_text("a whole\nfile\n")
    (tmp_path / "d.json").write_text(json.dumps([{"text": "x"}, {"text": "y"}]))
    (tmp_path / "notes.md").write_text("skipped in a directory")
    (tmp_path / "sub").mkdir()
    _jsonl(tmp_path / "sub" / "e.jsonl", [{"text": "not read: only files directly inside"}])

    files = data_files(str(tmp_path))
    assert [Path(f).name for f in files] == ["a.parquet", "b.jsonl", "c.txt", "d.json"]
    assert data_files(str(tmp_path / "*.jsonl")) == [str(tmp_path / "b.jsonl")]
    rows = list(read_rows(files))
    assert [(Path(r.source).name, r.number, row_kind(r)) for r in rows] == [
        ("a.parquet", 1, "messages"), ("a.parquet", 2, "messages"),
        ("b.jsonl", 1, "text"), ("b.jsonl", 2, "prompt_completion"),
        ("c.txt", 1, "text"), ("d.json", 1, "text"), ("d.json", 2, "text")]
    assert rows[0].value["messages"] == CHAT and rows[4].value == {"text": "a whole\nfile\n"}


def test_parquet_mixing_shapes_leaves_other_columns_null(tmp_path: Path) -> None:
    rows = [{"text": "a"}, {"prompt": "p", "completion": "c"}, {"messages": CHAT[1:3]}, {}]
    columns = {key: [row.get(key) for row in rows]
               for key in ("text", "prompt", "completion", "messages")}
    pq.write_table(pa.table(columns), tmp_path / "mixed.parquet")
    read = list(read_rows([str(tmp_path / "mixed.parquet")]))
    assert [row_kind(r) for r in read[:3]] == ["text", "prompt_completion", "messages"]
    with pytest.raises(TaskError, match=r"mixed\.parquet:4 has keys \(none\)"):
        row_kind(read[3])


def test_memory_url_and_glob() -> None:
    fs = fsspec.filesystem("memory")
    for name in ("x1.jsonl", "x2.jsonl"):
        with fs.open(f"/ftdata/{name}", "w") as f:
            f.write(json.dumps({"text": name}) + "\n")
    try:
        assert data_files("memory://ftdata/x*.jsonl") == ["memory:///ftdata/x1.jsonl",
                                                          "memory:///ftdata/x2.jsonl"]
        files = data_files("memory://ftdata")
        assert [r.value["text"] for r in read_rows(files)] == ["x1.jsonl", "x2.jsonl"]
    finally:
        fs.rm("/ftdata", recursive=True)


# --- packing -----------------------------------------------------------------------------------

DOCS = [([1, 2, 3], [True, True, True]), ([4, 5], [False, True]), ([6, 7, 8, 9, 10], [True] * 5)]


def test_pack_keeps_documents_whole_and_resets_positions() -> None:
    p = pack(DOCS, 6, pad_id=0, mode="pack")
    assert p.input_ids.dtype == p.labels.dtype == p.position_ids.dtype == np.int32
    np.testing.assert_array_equal(p.input_ids, [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 10, 0]])
    # -100 at each document's first token, on masked tokens and on padding.
    np.testing.assert_array_equal(p.labels, [[IGNORE, 2, 3, IGNORE, 5, IGNORE],
                                             [IGNORE, 7, 8, 9, 10, IGNORE]])
    np.testing.assert_array_equal(p.position_ids, [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 0]])
    assert (p.docs, p.rows, p.truncated, p.tokens, p.loss_tokens) == (3, 2, 0, 10, 7)


def test_pack_truncates_long_documents_and_counts_them() -> None:
    p = pack(DOCS, 4, pad_id=0, mode="pack")
    np.testing.assert_array_equal(p.input_ids, [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    np.testing.assert_array_equal(p.position_ids, [[0, 1, 2, 0], [0, 1, 0, 1], [0, 1, 2, 3]])
    assert p.truncated == 1 and p.rows == 3


def test_pack_drops_a_document_left_with_nothing_to_learn() -> None:
    long_prompt = ([1] * 8 + [2, 3], [False] * 8 + [True, True])
    p = pack([long_prompt, DOCS[0]], 4, pad_id=0, mode="pack")
    assert p.stats.dropped == 1 and p.truncated == 1 and p.rows == 1
    np.testing.assert_array_equal(p.input_ids, [[1, 2, 3, 0]])


def test_concat_carries_documents_across_rows() -> None:
    p = pack(DOCS, 4, pad_id=0, mode="concat")
    np.testing.assert_array_equal(p.input_ids, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]])
    np.testing.assert_array_equal(p.position_ids, [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 0, 1]])
    np.testing.assert_array_equal(p.labels, [[IGNORE, 2, 3, IGNORE], [IGNORE, IGNORE, 7, 8],
                                             [IGNORE, 10, IGNORE, IGNORE]])
    assert (p.rows, p.truncated, p.tokens) == (3, 0, 10)


def test_pad_puts_one_document_per_row() -> None:
    p = pack(DOCS, 4, pad_id=9, mode="pad")
    np.testing.assert_array_equal(p.input_ids, [[1, 2, 3, 9], [4, 5, 9, 9], [6, 7, 8, 9]])
    np.testing.assert_array_equal(p.labels[1], [IGNORE, 5, IGNORE, IGNORE])
    np.testing.assert_array_equal(p.position_ids[1], [0, 1, 0, 1])
    assert (p.rows, p.truncated) == (3, 1)


def test_packing_is_deterministic_and_checks_its_mode() -> None:
    a, b = pack(DOCS, 5, pad_id=0, mode="pack"), pack(DOCS, 5, pad_id=0, mode="pack")
    for name in ("input_ids", "labels", "position_ids"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    with pytest.raises(TaskError, match="not one of concat, pack, pad"):
        pack(DOCS, 5, pad_id=0, mode="shuffle")


# --- the token cache ---------------------------------------------------------------------------

def _prepare(tok_dir: Path, data: Path, cache: Path, **kw) -> Path:
    args = {"val_data": None, "val_fraction": 0.0, "seq_len": 32, "mode": "pack"} | kw
    return prepare(data=str(data), tokenizer_dir=str(tok_dir), cache_dir=str(cache), **args)


def _mixed_rows(n: int) -> list[dict]:
    shapes = [{"messages": CHAT}, {"prompt": "what is two plus two", "completion": " four"},
              {"text": "the quick brown fox jumps over the lazy dog"}]
    return [shapes[i % 3] for i in range(n)]


def test_prepare_writes_packed_splits_and_reuses_the_cache(
        tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _jsonl(tmp_path / "train.jsonl", _mixed_rows(60))
    out = _prepare(tok_dir, data, tmp_path / "cache", val_fraction=0.2, seq_len=64)
    stats = read_stats(out)
    assert out.name.startswith("finetune-") and stats["kinds"] == {
        "messages": 20, "prompt_completion": 20, "text": 20}
    assert stats["val"] is not None and stats["train"]["docs"] + stats["val"]["docs"] == 60
    assert 0 < stats["val"]["docs"] < 30

    train = PackedRows(out / "train")
    assert len(train) == stats["train"]["rows"] and train.seq_len == 64
    batch = train.get_batch([0, len(train) - 1, 0])
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    for tensor in batch.values():
        assert tensor.dtype == torch.int64 and tensor.shape == (3, 64)
    assert torch.equal(batch["input_ids"][0], batch["input_ids"][2])
    assert int((batch["labels"] != IGNORE).sum()) > 0
    again = pickle.loads(pickle.dumps(train))  # a worker's copy maps the files itself
    assert torch.equal(again[0]["input_ids"], batch["input_ids"][0])

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cache hit must not tokenize again")

    monkeypatch.setattr(token_cache, "_build", no_rebuild)
    assert _prepare(tok_dir, data, tmp_path / "cache", val_fraction=0.2, seq_len=64) == out


def test_separate_validation_files_and_no_split(tok_dir: Path, tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "train.jsonl", _mixed_rows(6))
    val = _jsonl(tmp_path / "val.jsonl", _mixed_rows(3))
    out = _prepare(tok_dir, data, tmp_path / "cache", val_data=str(val), val_fraction=0.5)
    stats = read_stats(out)
    assert (stats["train"]["docs"], stats["val"]["docs"]) == (6, 3)
    assert len(PackedRows(out / "val")) == stats["val"]["rows"]
    none = _prepare(tok_dir, data, tmp_path / "cache")
    assert read_stats(none)["val"] is None and not (none / "val").exists()


def test_cache_key_follows_data_content_and_tokenizer(tok_dir: Path, tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "train.jsonl", _mixed_rows(3))

    def key(tokenizer_dir: Path = tok_dir, **kw) -> str:
        args = {"val_files": [], "seq_len": 32, "mode": "pack", "val_fraction": 0.0,
                "val_data": None} | kw
        return data_key(files=[str(data)], tokenizer_dir=str(tokenizer_dir), **args)

    before = key()
    assert key() == before
    assert key(seq_len=64) != before and key(mode="concat") != before
    assert key(val_fraction=0.1) != before
    other_tok = _save_tokenizer(tmp_path / "tok2", CHATML.replace("<|im_end|>\n", "<|im_end|>"))
    assert key(other_tok) != before
    _jsonl(data, _mixed_rows(4))
    assert key() != before


def test_empty_training_split_is_an_error(tok_dir: Path, tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "train.jsonl", [{"prompt": "the cat sat on the mat " * 20,
                                               "completion": "four"}])
    with pytest.raises(TaskError, match="gives no training rows"):
        _prepare(tok_dir, data, tmp_path / "cache", seq_len=8)
    assert not list((tmp_path / "cache").glob("finetune-*/"))


def test_prepare_reads_parquet_and_memory_urls(tok_dir: Path, tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["the cat"] * 4, "completion": [" sat"] * 4}),
                   tmp_path / "rows.parquet")
    out = _prepare(tok_dir, tmp_path / "rows.parquet", tmp_path / "cache", mode="pad", seq_len=8)
    assert read_stats(out)["train"]["rows"] == 4

    fs = fsspec.filesystem("memory")
    with fs.open("/ftcache/rows.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in _mixed_rows(3)))
    try:
        out = prepare(data="memory://ftcache/*.jsonl", val_data=None, val_fraction=0.0,
                      tokenizer_dir=str(tok_dir), seq_len=128, mode="concat",
                      cache_dir=str(tmp_path / "cache"))
    finally:
        fs.rm("/ftcache", recursive=True)
    assert read_stats(out)["train"]["docs"] == 3 and read_stats(out)["mode"] == "concat"


def test_unloadable_tokenizer_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=f"the tokenizer at {tmp_path} cannot be loaded"):
        load_tokenizer(str(tmp_path))
