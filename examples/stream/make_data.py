"""Write a synthetic classification dataset for examples.stream: `features` and `label`.

    python -m examples.stream.make_data DIR [--rows 20000] [--files 4] [--row-group 512]
        [--features 16] [--classes 4] [--format parquet|arrow|json] [--seed 0]

The labels follow a fixed random linear rule of the features, so a model can learn them.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pyarrow as pa


def make_table(rows: int, features: int, classes: int, seed: int, first: int) -> pa.Table:
    rng = np.random.default_rng([seed, first])
    x = rng.standard_normal((rows, features), dtype=np.float32)
    w = np.random.default_rng(seed).standard_normal((features, classes)).astype(np.float32)
    label = (x @ w).argmax(axis=1).astype(np.int64)
    return pa.table({"id": np.arange(first, first + rows, dtype=np.int64),
                     "features": pa.FixedSizeListArray.from_arrays(x.reshape(-1), features),
                     "label": label})


def write(out: str, *, rows: int, files: int, row_group: int, features: int, classes: int,
          fmt: str, seed: int) -> list[str]:
    os.makedirs(out, exist_ok=True)
    per_file = -(-rows // files)
    paths = []
    for i in range(files):
        n = min(per_file, rows - i * per_file)
        if n <= 0:
            break
        table = make_table(n, features, classes, seed, i * per_file)
        path = os.path.join(out, f"part-{i:05d}.{ {'json': 'jsonl'}.get(fmt, fmt)}")
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, path, row_group_size=row_group)
        elif fmt == "arrow":
            with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
                for batch in table.to_batches(max_chunksize=row_group):
                    w.write_batch(batch)
        else:
            with open(path, "w") as f:
                for row in table.to_pylist():
                    f.write(json.dumps(row) + "\n")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--row-group", type=int, default=512)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--format", choices=["parquet", "arrow", "json"], default="parquet")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    paths = write(a.out, rows=a.rows, files=a.files, row_group=a.row_group,
                  features=a.features, classes=a.classes, fmt=a.format, seed=a.seed)
    print(f"wrote {a.rows} rows in {len(paths)} {a.format} files under {a.out}")


if __name__ == "__main__":
    main()
