"""Record the README's quickstart run: its command run as typed, timed, and its losses.

Writes docs/recorded/readme_run.json: the command's wall seconds, the first logged loss, the
final loss and val_loss, and the summary the command printed. Then it writes those figures
into README.md's quickstart and its "What you see" block (`--readme-only`: from the record,
without a run); tests/unit/test_readme_figures.py fails while the two disagree. Run it from
the repository root on an otherwise idle machine: `python -m bench.readme_run`. A few minutes
on 2 CPU cores.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT, STALWART, machine, parser, write_json
from bench.harness import run_watched
from stalwart.core.events import read_metrics

# The README's first command, after the install: what a newcomer types.
README_COMMAND = "stalwart run examples/gpt/config.toml"
RECORD = ROOT / "docs" / "recorded" / "readme_run.json"
README = ROOT / "README.md"
SUMMARY_START = "FINISHED"  # the summary block the command prints last


def command() -> list[str]:
    """README_COMMAND with this venv's stalwart: run from ROOT, so the relative path holds."""
    return [str(STALWART), *README_COMMAND.split()[1:]]


def run_dir_of(output: str) -> Path:
    """The run directory the summary names (`run dir: runs/gpt-...`), relative to ROOT."""
    found = re.findall(r"^\s*run dir: (\S+)$", output, flags=re.M)
    if not found:
        raise RuntimeError("the run printed no `run dir:` line")
    return ROOT / found[-1]


def summary_of(output: str) -> list[str]:
    """The last two progress lines and the summary block, as the README shows them: the
    repository's own path, which is the reader's, shown as `/…/`."""
    lines = output.replace(f"{ROOT}/", "/…/").splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith(SUMMARY_START))
    steps = [line for line in lines[:start] if line.startswith("step ")]
    return steps[-2:] + lines[start:]


def figures(run_dir: Path) -> dict[str, Any]:
    """The first logged loss and the final loss and val_loss, from the run's metrics."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    last_val = [r for r in rows if r.val_loss is not None][-1]
    return {"first_logged": {"step": rows[0].step, "loss": rows[0].loss},
            "final": {"step": rows[-1].step, "loss": rows[-1].loss,
                      "val_step": last_val.step, "val_loss": last_val.val_loss}}


def finished_seconds(summary: list[str]) -> float:
    """The seconds the summary's FINISHED line reports (the run, without the launch)."""
    match = re.search(r" in ([\d.]+)s", next(s for s in summary if s.startswith(SUMMARY_START)))
    if match is None:
        raise RuntimeError("the FINISHED line reports no time")
    return float(match.group(1))


def readme_with(text: str, record: dict[str, Any]) -> str:
    """README.md's text with the record's figures: the time, the losses, the summary."""
    wall, first, final = record["wall_s"], record["first_logged"], record["final"]
    minutes = f"{round(wall / 30) / 2:g}"  # to the half minute
    subs = [
        (r"about [\d.]+ minutes on (\d+) CPU cores \(\d+ s,",
         f"about {minutes} minutes on {record['machine']['cpus']} CPU cores ({round(wall)} s,"),
        (r"falls from [\d.]+ at step \d+ to about [\d.]+ nats per byte at step \d+",
         f"falls from {first['loss']:.1f} at step {first['step']} to about "
         f"{final['loss']:.1f} nats per byte at step {final['step']}"),
        (r"(## What you see\n.*?```\n).*?(\n```)",
         lambda m: m.group(1) + "\n".join(record["summary"]) + m.group(2)),
    ]
    for pattern, new in subs:
        text, n = re.subn(pattern, new, text, count=1, flags=re.S)
        if n != 1:
            raise SystemExit(f"README.md has no {pattern!r} to update")
    return text


def main() -> None:
    p = parser(__doc__, __spec__)
    p.add_argument("--out", default=str(RECORD), help="the record (docs/recorded/readme_run.json)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for the run")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    p.add_argument("--readme-only", action="store_true",
                   help="only write the record's figures into README.md; no run")
    args = p.parse_args()
    if args.readme_only:
        README.write_text(readme_with(README.read_text(), json.loads(Path(args.out).read_text())))
        return
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-readme-"))
    log = work / "run.log"
    print(f"readme_run: `{README_COMMAND}` from {ROOT}; output in {log}", flush=True)
    load_before = os.getloadavg()[0]
    if load_before > (os.cpu_count() or 1) / 2:
        print(f"WARNING: load average {load_before:.2f} on {os.cpu_count()} CPUs: the time "
              f"recorded is the README's, so record it on an otherwise idle machine",
              flush=True)
    code, wall = run_watched(command(), log, args.timeout)
    output = log.read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"the run exited {code} after {wall:.1f}s; see {log}")
    run_dir = run_dir_of(output)
    summary = summary_of(output)
    record = {"command": README_COMMAND, "wall_s": round(wall, 1),
              "finished_s": finished_seconds(summary), **figures(run_dir),
              "summary": summary, "date": datetime.date.today().isoformat(),
              "load_before": round(load_before, 2),
              "machine": machine()}
    write_json(args.out, record)
    README.write_text(readme_with(README.read_text(), record))
    print("\n".join(summary), f"README.md: {README_COMMAND} took {wall:.0f} s", sep="\n")
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
