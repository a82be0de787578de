"""The `stalwart` command line: argument parsing, run options, the Ray Jobs client, cluster
connection and the driver's progress display. Entry point: `stalwart.cli.main:main`."""
