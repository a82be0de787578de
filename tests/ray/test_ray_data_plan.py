"""from_ray: a Ray Data pipeline over parquet files streams every output row exactly once per
epoch, in an order two fresh streams agree on and that resumes deep in the stream; the
per-file counts are cached; operations and sources that break a per-file order are refused.

One local Ray (2 CPUs) serves the whole module. The pipelines' functions are closures made
inside `_pipeline`, so Ray's workers get them by value and never import this module.
"""

from __future__ import annotations

import json
import os
import shutil

import pandas as pd
import pytest

from stalwart.core.errors import DataError, DataUnavailable
from stalwart.data import from_ray
from stalwart.examples.stream.make_data import write

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ROWS, FILES = 600, 3
KEPT = [i for i in range(ROWS) if i % 3 != 0]  # what the pipeline's filter keeps


@pytest.fixture(scope="module", autouse=True)
def one_ray():
    import ray

    # address="local": a Ray of its own, never a cluster another process started here.
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    for stream in BOUND:  # their reads ahead run Ray Data pipelines: Ray must outlive them
        stream.close()
    ray.shutdown()


BOUND: list = []
"""Every stream the tests bound, closed before Ray shuts down."""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ray-data") / "d"
    write(str(out), rows=ROWS, files=FILES, row_group=50, features=2, classes=3,
          fmt="parquet", seed=0)
    return str(out)


def _pipeline(data_dir: str, counter: str, *, modulus: int = 3):
    """read -> map_batches (adds `twice`, and logs each call to `counter`) -> filter."""
    import ray

    def tag(batch):
        with open(counter, "a") as f:
            f.write(f"{len(batch['id'])}\n")
        batch["twice"] = batch["id"] * 2
        return batch

    def keep(row):
        return row["id"] % modulus != 0

    return ray.data.read_parquet(data_dir).map_batches(tag).filter(keep)


def _calls(counter) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def _bound(stream, cache_dir, seed=0):
    stream.bind(seed=seed, global_batch=8, cache_dir=str(cache_dir))
    BOUND.append(stream)
    return stream


# ---------------------------------------------------------------------- refused


def _refused_cases():
    import ray

    def base(d):
        return ray.data.read_parquet(d)

    return {
        "random_shuffle": (lambda d: base(d).random_shuffle(), r"\.random_shuffle\(\)"),
        "randomize_block_order": (lambda d: base(d).randomize_block_order(),
                                  r"\.randomize_block_order\(\)"),
        "sort": (lambda d: base(d).sort("id"), r"\.sort\(\)"),
        "groupby": (lambda d: base(d).groupby("label").count(), r"\.groupby\(\)"),
        "repartition": (lambda d: base(d).repartition(2, shuffle=True),
                        r"\.repartition\(shuffle=True\)"),
        "union": (lambda d: base(d).union(base(d)), r"\.union\(\).*mixes files"),
        "join": (lambda d: base(d).join(base(d), join_type="inner", num_partitions=2,
                                        on=("id",)), r"\.join\(\).*mixes files"),
        "limit": (lambda d: base(d).limit(5), r"\.limit\(\)"),
        "from_items": (lambda d: ray.data.from_items([{"a": 1}]),
                       r"ray\.data\.from_items, which is not files.*write_parquet"),
        "range": (lambda d: ray.data.range(10), r"not files.*read_parquet"),
        "from_pandas": (lambda d: ray.data.from_pandas(pd.DataFrame({"a": [1]})),
                        r"ray\.data\.from_pandas, which is not files"),
    }


@pytest.mark.parametrize("case", ["random_shuffle", "randomize_block_order", "sort", "groupby",
                                  "repartition", "union", "join", "limit", "from_items",
                                  "range", "from_pandas"])
def test_an_operation_that_breaks_the_per_file_order_is_refused_naming_it(data_dir, case):
    make, match = _refused_cases()[case]
    with pytest.raises(DataError, match=r"^from_ray: .*" + match) as err:
        from_ray(make(data_dir))
    # Every refusal says what to do instead.
    assert "Instead:" in str(err.value) or "write it to parquet" in str(err.value)


def test_not_a_ray_dataset_is_refused(data_dir):
    with pytest.raises(DataError, match="expected a ray.data.Dataset"):
        from_ray(data_dir)


def test_per_row_and_column_operations_are_accepted(data_dir):
    import ray

    ds = (ray.data.read_parquet(data_dir).select_columns(["id", "label"])
          .rename_columns({"label": "y"}).add_column("z", lambda b: b["y"] + 1)
          .drop_columns(["z"]).map(lambda r: r).flat_map(lambda r: [r]))
    stream = from_ray(ds)
    assert len(stream.files) == FILES and stream.fmt.name == "ray"


# ---------------------------------------------------------------------- streaming


@pytest.fixture(scope="module")
def indexed(data_dir, tmp_path_factory):
    """The pipeline's counter file and a cache holding its index: the index pass ran once."""
    root = tmp_path_factory.mktemp("indexed")
    counter, cache = root / "calls", root / "cache"
    stream = _bound(from_ray(_pipeline(data_dir, str(counter))), cache)
    return counter, cache, _calls(counter), stream.identity()["data"]["plan"]


def test_every_output_row_once_per_epoch_the_same_order_twice_and_a_deep_read(data_dir,
                                                                              indexed):
    counter, cache, _, _ = indexed
    stream = _bound(from_ray(_pipeline(data_dir, str(counter)), columns=["id", "twice"]), cache)
    n = len(KEPT)
    assert len(stream) == n
    whole, ids = stream.read(0, 2 * n)
    got = whole["id"].tolist()
    assert (whole["twice"] == 2 * whole["id"]).all()
    assert sorted(got[:n]) == KEPT and sorted(got[n:]) == KEPT  # exactly once per epoch
    assert got[:n] != got[n:]  # a new epoch, a new order
    assert ids.epoch.tolist() == [0] * n + [1] * n
    # (file, row) names each sample: its file holds ids from file * 200, and its row counts
    # the rows the pipeline kept before it in that file.
    per_file = ROWS // FILES
    for f, r, i in zip(ids.file[:n].tolist(), ids.row[:n].tolist(), got[:n], strict=True):
        assert i // per_file == f
        assert r == len([k for k in KEPT if f * per_file <= k < i])

    again = _bound(from_ray(_pipeline(data_dir, str(counter)), columns=["id", "twice"]), cache)
    assert again.read(0, n)[0]["id"].tolist() == got[:n]
    # A fresh stream deep in the order (across the epoch boundary) reads what the pass did.
    k = n - 5
    fresh = _bound(from_ray(_pipeline(data_dir, str(counter)), columns=["id"]), cache)
    assert fresh.read(k, 20)[0]["id"].tolist() == got[k:k + 20]

    # A fixed validation set reads rows by their index in file order.
    assert stream.get_batch([0, 1, n - 1])["id"].tolist() == [1, 2, KEPT[-1]]


# ---------------------------------------------------------------------- the index pass


def test_the_counts_are_cached_per_file_and_pipeline(data_dir, indexed):
    counter, cache, indexed_calls, plan = indexed
    assert indexed_calls > 0
    assert len(os.listdir(cache / "stream-index")) == FILES
    calls = _calls(counter)  # the index pass, and any reads since

    # A fresh stream of the same pipeline binds from the cache: the pipeline does not run.
    again = _bound(from_ray(_pipeline(data_dir, str(counter))), cache)
    assert _calls(counter) == calls
    assert len(again) == len(KEPT) and again.identity()["data"]["plan"] == plan

    # Another pipeline (a filter keeping other rows) counts again, under entries of its own.
    other = _bound(from_ray(_pipeline(data_dir, str(counter), modulus=2)), cache)
    assert _calls(counter) > calls
    assert len(os.listdir(cache / "stream-index")) == 2 * FILES
    assert len(other) == ROWS // 2 and other.identity()["data"]["plan"] != plan


def test_a_unit_whose_count_changed_since_the_index_is_unavailable(data_dir, indexed,
                                                                  tmp_path):
    counter, cache, _, _ = indexed
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    # As if the pipeline had given other counts when the index pass ran.
    for path in (copy / "stream-index").iterdir():
        entry = json.loads(path.read_text())
        path.write_text(json.dumps({**entry, "rows": entry["rows"] + 1}))
    stream = _bound(from_ray(_pipeline(data_dir, str(counter))), copy)
    with pytest.raises(DataUnavailable, match="not deterministic or the file changed"):
        stream.read(0, 8)
