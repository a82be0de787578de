"""The basement: the types every room shares, and nothing else.

config/ (the JobConfig tree, loading, --set), errors (the typed errors), events (the run
directory's schema) and run_logs (its two logs), task (the TrainTask contract), batch (what a
batch may be), metric_names and records (how rows are read and written). The lower rooms
(orchestrator, workers, parallel, checkpointing) import only this from `stalwart`; the
basement imports no room at all. tests/unit/test_layering.py holds both rules.
"""
