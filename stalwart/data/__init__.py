"""Datasets for a task: streams from files or Ray Data, and fine-tuning rows, tokenized once.

`read_parquet`, `read_arrow`, `read_json`, `read_text`, `from_huggingface` and `from_ray`
return streams that a task's `train_dataset` hands to stalwart: read a unit at a time, in an
order that any world resumes exactly (docs/data.md).
"""

from stalwart.data.readers import (
    from_huggingface,
    from_ray,
    read_arrow,
    read_json,
    read_parquet,
    read_text,
)

__all__ = ["from_huggingface", "from_ray", "read_arrow", "read_json", "read_parquet", "read_text"]
