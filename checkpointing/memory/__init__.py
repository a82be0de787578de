"""The memory tier: per-rank snapshots held in CPU memory and replicated to a peer on
another node, their inventory and catalog, and the reader that restores from them."""
