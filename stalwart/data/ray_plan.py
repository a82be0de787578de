"""Every use of Ray Data's private plan structures, in one place: check a Dataset's logical plan,
list its input files, fingerprint its transforms, and run it on one file at a time.

`stalwart.data.from_ray` owns the order of a Ray Data pipeline's rows, so the pipeline must
map each input file to rows on its own: a file-based source followed by per-row and per-batch
operations only. Ray has no public API for a plan's operators or for running a plan on a
subset of its files, so this module walks `Dataset._logical_plan.dag` and rebuilds it with the
read restricted to one file. All of it was read from Ray 2.60.0 (`ray.data._internal.logical`,
`ray.data._internal.datasource_v2`); a plan of another shape is refused with an error that
names this module, so an upgrade of Ray breaks here and nowhere else.

Ray is imported inside each function: importing stalwart.data stays light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from stalwart.core.errors import DataError

WHAT = "from_ray"

# Operators that map each input file's rows on their own, deterministically given
# deterministic functions: the API that makes each, for the error that lists them.
_ALLOWED = {
    "MapRows": ".map", "MapBatches": ".map_batches / .add_column",
    "Filter": ".filter", "FlatMap": ".flat_map",
    "Project": ".select_columns / .drop_columns / .rename_columns / .with_column",
    "StreamingRepartition": ".repartition(target_num_rows_per_block=...)",
}
_ALLOWED_TEXT = ("map, map_batches, filter, flat_map, add_column, drop_columns, "
                 "select_columns, rename_columns, with_column")

# Operators that mix files, reorder rows or drop a count of rows: the API that makes each,
# and what to do instead.
_REFUSED = {
    "RandomShuffle": (".random_shuffle()", "stalwart shuffles the rows itself, seeded and "
                      "resumable: remove it and use from_ray(shuffle=True, window=...)"),
    "RandomizeBlocks": (".randomize_block_order()", "stalwart shuffles the files itself: "
                        "remove it"),
    "Sort": (".sort()", "sort the rows when writing the files, or remove it"),
    "Aggregate": (".groupby() / .aggregate() / .unique() / .sum() ...",
                  "compute it beforehand and write the result to parquet"),
    "Repartition": (".repartition(shuffle=True) or .repartition(keys=...)",
                    "remove it, or repartition with shuffle=False and no keys"),
    "Union": (".union()", "read all the files in one dataset: "
              "ray.data.read_parquet([path_a, path_b])"),
    "Zip": (".zip()", "join the columns beforehand and write the result to parquet"),
    "Join": (".join()", "join beforehand and write the result to parquet"),
    "Mix": (".mix()", "read all the files in one dataset"),
    "Limit": (".limit()", "stalwart reads every row once per epoch; to train on fewer rows, "
              "give fewer files, or train fewer train.steps"),
}

_NOT_FILES = ("its source is {source}, which is not files: write it to parquet "
              "(dataset.write_parquet(dir)) and pass ray.data.read_parquet(dir), or use "
              "stalwart.data.read_parquet(dir)")


@dataclass(frozen=True)
class SourceFile:
    path: str
    """The file as Ray's filesystem names it (no scheme for object stores)."""
    url: str
    """The same file as an fsspec URL (a plain path for local files)."""


class RayPlan:
    """A Ray Data pipeline checked to map each input file to rows on its own."""

    def __init__(self, dataset: Any) -> None:
        import ray.data

        if not isinstance(dataset, ray.data.Dataset):
            raise DataError(f"{WHAT}: expected a ray.data.Dataset, got "
                            f"{type(dataset).__name__}")
        self.context = dataset.context
        self.dag = _dag(dataset)
        self.ops = list(self.dag.post_order_iter())
        self.source = _check(self.ops)
        self.fingerprint = _fingerprint(self.ops)

    # ------------------------------------------------------------------ the files

    def files(self) -> list[SourceFile]:
        """The input files, sorted by URL."""
        paths, fs = _source_paths(self.source)
        if not paths:
            raise DataError(f"{WHAT}: the dataset's source lists no files")
        files = {(url := _url(fs, p)): SourceFile(p, url) for p in paths}
        return [files[u] for u in sorted(files)]

    def source_paths(self) -> list[str]:
        """What the user passed to the reader (for the run's manifest)."""
        import ray

        if type(self.source).__name__ == "ListFiles":
            paths: Any = self.source.source_paths
        else:
            ref = getattr(self.source.datasource, "_source_paths_ref", None)
            paths = ray.get(ref) if ref is not None else []
        return [str(paths)] if isinstance(paths, str) else [str(p) for p in paths or []]

    # ------------------------------------------------------------------ one file

    def on_file(self, file: SourceFile) -> Any:
        """The pipeline as a Dataset over `file` alone, rows in the order the file holds them."""
        import ray.data
        from ray.data._internal.logical.interfaces import LogicalPlan
        from ray.data._internal.stats import DatasetStats

        restrict = _restrictor(self.source, file.path)
        dag = self.dag._apply_transform(lambda op: restrict(op) if op is self.source else op)
        context = self.context.copy()
        # Blocks of one file come out in the file's order, whatever finishes first.
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        return ray.data.Dataset(logical_plan=LogicalPlan(dag, context), context=context,
                                in_stats=DatasetStats(metadata={}, parent=None))

    def read(self, file: SourceFile) -> pa.Table:
        """The pipeline's rows for `file`, in order, as one table."""
        import ray

        try:
            tables = ray.get(self.on_file(file).to_arrow_refs())
        finally:
            _join_executors()
        tables = [t for t in tables if t.num_columns]
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="default")

    def count(self, file: SourceFile) -> tuple[int, pa.Schema | None]:
        """The pipeline's row count for `file` and its schema (None for no rows), without
        fetching the rows here: only one block, when its schema is not Arrow's already."""
        import ray
        from ray.data.block import BlockAccessor

        with _executed(self.on_file(file).iter_internal_ref_bundles()) as bundles:
            rows, schema, first = _tally(bundles)
        if schema is None and first is not None:
            schema = BlockAccessor.for_block(ray.get(first)).to_arrow().schema
        return rows, schema


def _tally(bundles: Iterator[Any]) -> tuple[int, pa.Schema | None, Any]:
    """Rows of executed blocks, their Arrow schema where the metadata has it, else the first
    non-empty block's reference (to read the schema from)."""
    rows, schema, first = 0, None, None
    for bundle in bundles:
        n = bundle.num_rows()
        if n is None:
            raise _unexpected("an executed block of the pipeline has no row count")
        rows += n
        if n and schema is None:
            base = getattr(bundle.schema, "base_schema", bundle.schema)
            if isinstance(base, pa.Schema):
                schema = base
            elif first is None:
                first = bundle.block_refs[0]
    return rows, schema, first


@contextlib.contextmanager
def _executed(bundles: Iterator[Any]) -> Iterator[Iterator[Any]]:
    """An execution's output, closed (its executor shut down) and its thread ended on the
    way out, raised or not."""
    try:
        yield bundles
    finally:
        close = getattr(bundles, "close", None)
        if close is not None:
            close()
        _join_executors()


# How long an ended execution's thread may take to leave.
EXECUTOR_EXIT_S = 60.0


def _join_executors() -> None:
    """Wait for the threads of Ray Data's ended executions. Ray gives one 2 s to leave its
    loop; on a loaded machine it may still be in a `ray.wait` on a task's output stream when
    Ray shuts down, and Ray's core worker then aborts the whole process."""
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    deadline = time.monotonic() + EXECUTOR_EXIT_S
    for thread in threading.enumerate():
        if isinstance(thread, StreamingExecutor) and getattr(thread, "_shutdown", False):
            thread.join(max(0.0, deadline - time.monotonic()))


def _dag(dataset: Any) -> Any:
    plan = getattr(dataset, "_logical_plan", None)
    dag = getattr(plan, "dag", None)
    if dag is None or not hasattr(dag, "post_order_iter") or not hasattr(dag,
                                                                         "_apply_transform"):
        raise _unexpected("the Dataset has no `_logical_plan.dag` of logical operators")
    return dag


def _unexpected(what: str) -> DataError:
    import ray

    return DataError(f"{WHAT}: {what}. stalwart/data/ray_plan.py reads Ray Data's private "
                     f"logical plan as Ray 2.60.0 builds it; this is Ray {ray.__version__}, "
                     f"whose plan has another shape: update that module for it")


# ---------------------------------------------------------------------- checking


def _check(ops: list[Any]) -> Any:
    """The plan's one file-based source operator, or DataError naming the operation that
    breaks a deterministic per-file order (or the source that is not files)."""
    for op in ops:
        kind = type(op).__name__
        if kind in _REFUSED:
            api, instead = _REFUSED[kind]
            if kind == "Repartition" and not op.shuffle and not op.keys:
                continue  # splits blocks, keeps the order: harmless on one file
            effect = ("mixes files" if kind in ("Union", "Zip", "Join", "Mix")
                      else "changes the order or the count of rows")
            raise DataError(f"{WHAT}: the dataset uses {api} ({op.name}), which {effect}; "
                            f"stalwart needs each file's rows in a deterministic order. "
                            f"Instead: {instead}. Allowed after the read: {_ALLOWED_TEXT}")
    sources = [op for op in ops if not op.input_dependencies]
    if len(sources) != 1:
        raise _unexpected(f"the plan has {len(sources)} source operators where one was expected")
    source = sources[0]
    _check_source(source)
    for op in ops:
        kind = type(op).__name__
        if op is source or (kind == "ReadFiles" and op.input_dependencies == [source]):
            continue
        if kind not in _ALLOWED and kind != "Repartition":  # a plain one passed above
            raise DataError(f"{WHAT}: the dataset uses {op.name} ({kind}), which from_ray "
                            f"cannot check keeps each file's rows in a deterministic order. "
                            f"Allowed after the read: {_ALLOWED_TEXT}")
    return source


def _check_source(source: Any) -> None:
    kind = type(source).__name__
    if kind == "ListFiles":
        if source.filesystem is None:
            raise DataError(f"{WHAT}: the dataset's reader finds its own data rather than "
                            f"reading files; " + _NOT_FILES.format(source=source.name))
        return
    if kind == "Read":
        from ray.data.datasource import FileBasedDatasource

        datasource = source.datasource
        if isinstance(datasource, FileBasedDatasource) or _is_v1_parquet(datasource):
            return
        raise DataError(f"{WHAT}: the dataset cannot be streamed: "
                        + _NOT_FILES.format(source=f"{source.name} "
                                            f"({type(datasource).__name__})"))
    names = {"FromItems": "ray.data.from_items", "FromPandas": "ray.data.from_pandas",
             "FromArrow": "ray.data.from_arrow", "FromNumpy": "ray.data.from_numpy",
             "FromBlocks": "ray.data.from_blocks",
             "InputData": "data in memory (a materialized dataset)"}
    if kind in names or kind.startswith("From"):
        raise DataError(f"{WHAT}: the dataset cannot be streamed: "
                        + _NOT_FILES.format(source=names.get(kind, kind)))
    raise _unexpected(f"the plan's source is a {kind}, neither ListFiles nor Read")


def _is_v1_parquet(datasource: Any) -> bool:
    return type(datasource).__name__ == "ParquetDatasource" and hasattr(
        datasource, "_pq_fragments")


# ---------------------------------------------------------------------- files


def _source_paths(source: Any) -> tuple[list[str], Any]:
    """The files the source reads, as Ray lists them, and its pyarrow filesystem."""
    if type(source).__name__ == "ListFiles":
        from ray.data._internal.datasource_v2.common.listing_utils import _build_pruners

        pruners = _build_pruners(source.file_extensions, source.partition_filter,
                                 source.partition_pruner)
        infos = source.file_indexer.list_file_infos(
            pa.array(list(source.paths), pa.string()), filesystem=source.filesystem,
            pruners=pruners, preserve_order=True)
        return [info.path for info in infos], source.filesystem
    datasource = source.datasource
    if _is_v1_parquet(datasource):
        return list(datasource._pq_paths), datasource._filesystem
    return list(datasource._paths()), datasource._filesystem


def _url(fs: Any, path: str) -> str:
    """An fsspec URL for a path of a pyarrow filesystem: stalwart stats files through fsspec,
    as the resume check does."""
    import pyarrow.fs as pafs

    while hasattr(fs, "unwrap"):  # Ray's retrying wrapper
        inner = fs.unwrap()
        if inner is fs:
            break
        fs = inner
    if fs is None or isinstance(fs, pafs.LocalFileSystem):
        return path
    handler = getattr(fs, "handler", None)
    inner = getattr(handler, "fs", None)  # an fsspec filesystem behind pyarrow's FSSpecHandler
    if inner is not None and hasattr(inner, "unstrip_protocol"):
        return path if "file" in _protocols(inner) else inner.unstrip_protocol(path)
    scheme = {"gcs": "gs"}.get(fs.type_name, fs.type_name)
    return path if scheme in ("local", "file") else f"{scheme}://{path}"


def _protocols(fs: Any) -> tuple[str, ...]:
    return fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)


def _restrictor(source: Any, path: str) -> Callable[[Any], Any]:
    """A function that returns the source operator restricted to the file `path`."""
    if type(source).__name__ == "ListFiles":
        return lambda op: dataclasses.replace(op, paths=[path], source_paths=[path])

    def restrict(op: Any) -> Any:
        import copy

        import ray

        datasource = copy.copy(op.datasource)
        if _is_v1_parquet(datasource):
            keep = [i for i, p in enumerate(datasource._pq_paths) if p == path]
            datasource._pq_fragments = [datasource._pq_fragments[i] for i in keep]
            datasource._pq_paths = [path] * len(keep)
        else:
            sizes = dict(zip(datasource._paths(), datasource._file_sizes(), strict=True))
            datasource._paths_ref = ray.put([path])
            datasource._file_sizes_ref = ray.put([sizes.get(path)])
        return dataclasses.replace(op, datasource=datasource,
                                   datasource_or_legacy_reader=datasource)

    return restrict


# ---------------------------------------------------------------------- fingerprint

# Fields that say how the plan runs (resources, block sizes, listing machinery), not what
# rows it makes: left out of the fingerprint.
_HOW = {"compute", "ray_remote_args", "ray_remote_args_fn", "parallelism", "num_outputs",
        "detected_parallelism", "min_rows_per_bundled_input", "per_block_limit",
        "sub_progress_bar_names", "zero_copy_batch", "target_num_rows_per_block", "strict",
        "file_indexer", "filesystem", "file_partitioner", "shuffle_config_factory",
        "datasource", "datasource_or_legacy_reader", "scanner", "schema", "paths",
        "source_paths", "can_modify_num_rows"}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")


def _fingerprint(ops: list[Any]) -> str:
    """What the plan does to each file's rows: each operator's name, its functions' qualified
    names, code, defaults and captured (closure) values, and its arguments' repr. Equal plans
    give equal fingerprints in any process. Globals a function reads are not seen."""
    lines = []
    for op in ops:
        if not dataclasses.is_dataclass(op):
            raise _unexpected(f"the plan's operator {type(op).__name__} is not a dataclass")
        parts = [type(op).__name__, op.name]
        if type(op).__name__ == "Read":
            parts.append(type(op.datasource).__name__)
        for f in dataclasses.fields(op):
            if f.name.lstrip("_") in _HOW or f.name in ("_input_dependencies",
                                                         "input_dependencies", "_name"):
                continue
            parts.append(f"{f.name}={_stable(getattr(op, f.name, None))}")
        lines.append(" ".join(parts))
    return "\n".join(lines)


_DEPTH = 3  # nested containers and closures followed this deep


def _stable(value: Any, depth: int = 0) -> str:
    """A repr that is the same in every process: functions by name and code, no addresses,
    long reprs by their hash."""
    if depth > _DEPTH:
        return type(value).__qualname__
    if isinstance(value, functools.partial):
        return (f"partial({_stable(value.func, depth + 1)}, {_stable(value.args, depth + 1)}, "
                f"{_stable(value.keywords, depth + 1)})")
    if callable(value):
        return _describe_callable(value, depth)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_stable(v, depth + 1) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_short(repr(k))}: {_stable(v, depth + 1)}" for k, v in
                               sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    try:
        return _short(repr(value))
    except Exception:  # a repr that fails says nothing stable
        return type(value).__qualname__


def _short(text: str) -> str:
    text = _ADDRESS.sub("", text)
    return text if len(text) <= 200 else "sha:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _describe_callable(fn: Any, depth: int) -> str:
    owner = fn if isinstance(fn, type) or hasattr(fn, "__code__") else type(fn)
    name = f"{getattr(owner, '__module__', '?')}.{getattr(owner, '__qualname__', '?')}"
    # A function's own code, or a callable class's (or object's) __call__.
    code = getattr(fn, "__code__", None) or getattr(
        inspect.getattr_static(owner, "__call__", None), "__code__", None)
    if code is None:
        return name
    digest = hashlib.sha256(code.co_code)
    digest.update(_ADDRESS.sub("", repr(code.co_consts)).encode())
    digest.update(repr(code.co_names).encode())
    # What the function was made with: its defaults and the values its closure captured.
    func = getattr(fn, "__func__", fn)
    made_with = [getattr(func, "__defaults__", None), getattr(func, "__kwdefaults__", None)]
    for cell in getattr(func, "__closure__", None) or ():
        try:
            made_with.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            made_with.append(None)
    digest.update(_stable(made_with, depth + 1).encode())
    return f"{name}#{digest.hexdigest()[:12]}"
