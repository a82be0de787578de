"""Streams from files: each format's rows, resume at any position, and one clear error for
each kind of bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stalwart.core.errors import DataError, DataUnavailable
from stalwart.data import read_arrow, read_json, read_parquet, read_text
from stalwart.data import stream as stream_module
from stalwart.data.changes import check_data_files
from stalwart.examples.stream.make_data import write

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _bound(stream, tmp_path, g=8, seed=0):
    stream.bind(seed=seed, global_batch=g, cache_dir=str(tmp_path / "cache"))
    return stream


def _ids(stream, start, count):
    batch, ids = stream.read(start, count)
    return batch, list(zip(ids.epoch.tolist(), ids.file.tolist(), ids.row.tolist(), strict=True))


@pytest.mark.parametrize("fmt,reader", [("parquet", read_parquet), ("arrow", read_arrow),
                                        ("json", read_json)])
def test_each_format_streams_every_row_once_per_epoch(tmp_path, fmt, reader):
    write(str(tmp_path / "d"), rows=700, files=3, row_group=64, features=4, classes=3,
          fmt=fmt, seed=1)
    stream = _bound(reader(str(tmp_path / "d"), columns=["id", "label"]), tmp_path)
    assert len(stream) == 700
    batch, ids = _ids(stream, 0, 700)
    assert sorted(batch["id"].tolist()) == list(range(700))
    assert len(set(ids)) == 700 and {e for e, _, _ in ids} == {0}
    # A sample's (file, row) names its row in its file: part i holds ids from i * 234.
    for (_, f, r), sample_id in zip(ids, batch["id"].tolist(), strict=True):
        assert sample_id == f * 234 + r


def test_a_fresh_stream_resumes_deep_in_the_order_with_no_replay(tmp_path):
    write(str(tmp_path / "d"), rows=2000, files=4, row_group=50, features=4, classes=3,
          fmt="parquet", seed=0)
    whole = _bound(read_parquet(str(tmp_path / "d")), tmp_path)
    reference = whole.read(0, 4100)[0]["id"].tolist()
    for k in (0, 1237, 3990):
        stream_module._SHARED.clear()  # a fresh process: nothing read yet
        fresh = read_parquet(str(tmp_path / "d"))
        reads = []
        counted = fresh.fmt.read
        fresh.fmt.read = lambda *a, c=counted, r=reads: r.append(a[1]) or c(*a)
        got = _bound(fresh, tmp_path).read(k, 16)[0]["id"].tolist()
        assert got == reference[k:k + 16]
        # Only the windows around k were read: one per lane, of 40 units in all.
        assert 0 < len(reads) <= fresh._capacity < len(fresh.units)


def test_close_waits_for_the_reads_ahead_and_the_stream_reads_on_after(tmp_path):
    import threading

    write(str(tmp_path / "d"), rows=400, files=2, row_group=20, features=4, classes=3,
          fmt="parquet", seed=0)
    stream = _bound(read_parquet(str(tmp_path / "d"), window=2), tmp_path)
    first = stream.read(0, 8)[0]["id"].tolist()  # entering new units reads the next ahead
    assert any(t.name.startswith("stalwart-read") for t in threading.enumerate())
    stream.close()
    assert not any(t.name.startswith("stalwart-read") and t.is_alive()
                   for t in threading.enumerate())
    stream.close()  # again: nothing to do
    assert stream.read(0, 8)[0]["id"].tolist() == first
    assert len(stream.read(8, 392)[0]["id"]) == 392
    stream.close()


def test_default_batch_is_the_numeric_columns_and_a_transform_sees_every_column(tmp_path):
    write(str(tmp_path / "d"), rows=100, files=1, row_group=50, features=3, classes=2,
          fmt="parquet", seed=0)
    batch = _bound(read_parquet(str(tmp_path / "d")), tmp_path).read(0, 8)[0]
    assert sorted(batch) == ["features", "id", "label"]
    assert batch["features"].shape == (8, 3)
    seen = {}

    def transform(cols):
        seen.update(cols)
        return cols["features"].sum(axis=1)

    out = _bound(read_parquet(str(tmp_path / "d"), transform=transform), tmp_path).read(0, 8)[0]
    assert out.shape == (8,) and set(seen) == {"id", "features", "label"}


def test_text_lines_are_rows_and_blank_lines_are_skipped(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo\nthree\n")
    (tmp_path / "b.txt").write_text("four\nfive")
    stream = read_text(str(tmp_path / "*.txt"), shuffle=False,
                       transform=lambda cols: np.array([len(t) for t in cols["text"]]))
    _bound(stream, tmp_path, g=1)
    assert len(stream) == 5
    assert stream.read(0, 5)[0].tolist() == [3, 3, 5, 4, 4]


def test_a_hugging_face_style_arrow_stream_file_is_read_by_record_batch(tmp_path):
    table = pa.table({"x": np.arange(250, dtype=np.int64)})
    with pa.OSFile(str(tmp_path / "data-00000-of-00001.arrow"), "wb") as f:
        with pa.ipc.new_stream(f, table.schema) as w:
            for b in table.to_batches(max_chunksize=60):
                w.write_batch(b)
    stream = _bound(read_arrow(str(tmp_path), shuffle=False), tmp_path, g=10)
    assert len(stream.units) == 5
    assert stream.read(0, 250)[0]["x"].tolist() == list(range(250))


def test_a_new_stream_of_the_same_files_finds_the_units_already_read(tmp_path):
    # A survivor of a failure builds its next world's stream anew: what it read stays.
    write(str(tmp_path / "d"), rows=200, files=2, row_group=50, features=2, classes=2,
          fmt="parquet", seed=0)
    first = _bound(read_parquet(str(tmp_path / "d")), tmp_path)
    first.read(0, 8)
    second = _bound(read_parquet(str(tmp_path / "d")), tmp_path)
    assert second._cache is first._cache and len(second._cache) > 0
    other = _bound(read_parquet(str(tmp_path / "d"), columns=["id"]), tmp_path)
    assert other._cache is not first._cache


def test_a_json_index_is_cached_and_reused(tmp_path):
    write(str(tmp_path / "d"), rows=300, files=2, row_group=50, features=2, classes=2,
          fmt="json", seed=0)
    _bound(read_json(str(tmp_path / "d")), tmp_path)
    cached = os.listdir(tmp_path / "cache" / "stream-index")
    assert len(cached) == 2
    again = _bound(read_json(str(tmp_path / "d")), tmp_path)
    assert len(again) == 300


@pytest.mark.parametrize("make,match", [
    (lambda d: str(d / "nothing.parquet"), "does not exist"),
    (lambda d: str(d / "*.parquet"), "match no"),
    (lambda d: [], "no paths"),
])
def test_missing_files_are_refused_by_name(tmp_path, make, match):
    with pytest.raises(DataError, match=match):
        read_parquet(make(tmp_path))


def test_a_file_of_another_kind_is_refused(tmp_path):
    (tmp_path / "x.csv").write_text("a\n1\n")
    with pytest.raises(DataError, match="not a"):
        read_parquet(str(tmp_path / "x.csv"))


def test_an_unreadable_file_is_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet is not a readable parquet file"):
        _bound(read_parquet(str(tmp_path)), tmp_path)


def test_files_of_different_schemas_are_refused_naming_both(tmp_path):
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"x": [1.0, 2.0]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet has schema \{x: double\}.*a\.parquet"):
        _bound(read_parquet(str(tmp_path)), tmp_path, g=1)


def test_an_empty_dataset_and_a_batch_larger_than_the_data_are_refused(tmp_path):
    pq.write_table(pa.table({"x": pa.array([], pa.int64())}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match="dataset is empty"):
        _bound(read_parquet(str(tmp_path / "e.parquet")), tmp_path)
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "s.parquet")
    with pytest.raises(DataError, match=r"global batch \(8\) is larger than the dataset \(3"):
        _bound(read_parquet(str(tmp_path / "s.parquet")), tmp_path)


def test_unknown_columns_are_refused_naming_the_real_ones(tmp_path):
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "s.parquet")
    with pytest.raises(DataError, match=r"columns \['y'\] are not in the data; it has \['x'\]"):
        _bound(read_parquet(str(tmp_path), columns=["y"]), tmp_path, g=1)


def test_text_only_data_asks_for_a_transform(tmp_path):
    pq.write_table(pa.table({"s": ["a", "b"]}), tmp_path / "s.parquet")
    with pytest.raises(DataError, match="no numeric column.*transform="):
        _bound(read_parquet(str(tmp_path)), tmp_path, g=1).read(0, 1)


def test_a_file_gone_mid_run_and_a_corrupt_row_group_name_the_file(tmp_path):
    write(str(tmp_path / "d"), rows=400, files=2, row_group=50, features=2, classes=2,
          fmt="parquet", seed=0)
    stream = _bound(read_parquet(str(tmp_path / "d")), tmp_path)
    gone = tmp_path / "d" / "part-00001.parquet"
    os.rename(gone, tmp_path / "away")
    with pytest.raises(DataUnavailable, match="part-00001.parquet"):
        stream.read(0, 400)
    os.rename(tmp_path / "away", gone)
    assert len(stream.read(0, 400)[1].row) == 400, "readable again once the file is back"

    data = bytearray(gone.read_bytes())
    data[200:400] = b"\xff" * 200  # inside the first row group's pages
    gone.write_bytes(bytes(data))
    fresh = read_parquet(str(tmp_path / "d"))
    fresh.files = stream.files  # the index of the good file: the pages are what broke
    fresh.units, fresh.schema, fresh.fmt = stream.units, stream.schema, stream.fmt
    fresh.order = stream.order
    with pytest.raises(DataUnavailable, match=r"part-00001.parquet, row group \d+"):
        fresh.read(0, 400)


def _manifest(stream):
    return {"step": 7, **stream.identity()}


def test_a_resume_over_changed_files_is_refused_naming_them(tmp_path):
    d = tmp_path / "d"
    write(str(d), rows=300, files=3, row_group=50, features=2, classes=2, fmt="parquet", seed=0)
    manifest = _manifest(_bound(read_parquet(str(d / "*.parquet")), tmp_path))
    assert check_data_files(manifest, accept=False) == []
    pq.write_table(pa.table({"x": [1]}), d / "part-00009.parquet")
    os.remove(d / "part-00000.parquet")
    with open(d / "part-00001.parquet", "ab") as f:
        f.write(b"x")
    with pytest.raises(DataError) as e:
        check_data_files(manifest, accept=False)
    message = str(e.value)
    for name in ("1 added: ", "part-00009", "1 removed: ", "part-00000", "1 rewritten: ",
                 "part-00001", "data.accept_changed_files = true"):
        assert name in message
    assert len(check_data_files(manifest, accept=True)) == 3


def test_a_manifest_without_data_needs_no_check():
    assert check_data_files({"step": 3}, accept=False) == []


def test_options_are_checked(tmp_path):
    write(str(tmp_path / "d"), rows=100, files=1, row_group=50, features=2, classes=2,
          fmt="parquet", seed=0)
    with pytest.raises(DataError, match="window = 0"):
        read_parquet(str(tmp_path / "d"), window=0)
    with pytest.raises(DataError, match="must divide"):
        _bound(read_parquet(str(tmp_path / "d"), lanes=3), tmp_path, g=8)
    with pytest.raises(DataError, match="transform must be a function"):
        read_parquet(str(tmp_path / "d"), transform="tokenize")
    assert json.dumps(_bound(read_parquet(str(tmp_path / "d")), tmp_path).identity())


def test_a_hugging_face_dataset_streams_from_its_arrow_files(tmp_path):
    datasets = pytest.importorskip("datasets")
    from stalwart.data import from_huggingface

    ds = datasets.Dataset.from_dict({"x": list(range(300)), "t": ["a"] * 300})
    ds.save_to_disk(str(tmp_path / "saved"), max_shard_size="2KB")
    loaded = datasets.load_from_disk(str(tmp_path / "saved"))
    stream = _bound(from_huggingface(loaded, columns=["x"]), tmp_path, g=10)
    assert len(stream) == 300
    assert sorted(stream.read(0, 300)[0]["x"].tolist()) == list(range(300))
    with pytest.raises(DataError, match="flatten_indices"):
        from_huggingface(loaded.select([0, 5, 2]))
    with pytest.raises(DataError, match=r"has 10 rows but its files hold \d+"):
        _bound(from_huggingface(loaded.select(range(10))), tmp_path, g=1)
    with pytest.raises(DataError, match="no Arrow files"):
        from_huggingface(datasets.Dataset.from_dict({"x": [1]}))
