"""stalwart's benchmarks, one module per figure: run from the repository root as
`python -m bench.NAME` (docs/benchmarks.md has the method of each and the last figures)."""
