"""The storage tier: atomic DCP checkpoints on any fsspec URL (data first, manifest last),
their catalog and validation, copying a checkpoint into a run, and exporting weights."""
