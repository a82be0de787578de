"""`stalwart plan`: per-device memory estimates for every parallel layout, and the
recommended one. Pure arithmetic on a model's shape; nothing here starts a process."""
