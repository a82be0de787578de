"""Load: a pretrained model's safetensors read into N FSDP2 ranks by stalwart's engine, against
safetensors' load_file and transformers' from_pretrained in one process; peak RSS and time.

Every figure comes from a fresh process: the N gloo ranks building a `TrainEngine` for
`stalwart.tasks.hf:CausalLM` (built on meta, sharded, allocated, each rank reading its slices
through DCP's Hugging Face reader), one process calling `safetensors.torch.load_file` on every
file, and one calling `AutoModelForCausalLM.from_pretrained`. Memory is each process's peak
RSS growth over the load: the kernel's high-water mark (VmHWM) is reset right before it
starts, and a thread samples RSS every 5 ms (file-backed pages apart from anonymous ones).
The files are read once beforehand, so every reader finds them in the page cache.
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench import common

GOAL_RSS = 1.3  # peak growth per rank <= 1.3 x (model bytes / N) + the largest tensor
GOAL_THROUGHPUT = 0.8  # stalwart's bytes/s >= 0.8 x load_file's
MIB = 2**20
PAGE = 4096
PHASES = ("setup", "build", "shard_materialize", "load", "rest")


# ---------------------------------------------------------------------- memory


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _resident() -> tuple[int, int]:
    """(resident bytes, of which file-backed or shared): /proc/self/statm, cheap to read."""
    fields = Path("/proc/self/statm").read_text().split()
    return int(fields[1]) * PAGE, int(fields[2]) * PAGE


class PeakRSS:
    """The peak RSS growth of this process inside the block: VmHWM reset at entry (Linux
    clear_refs 5) and read at exit, and a 5 ms sampler for the split anonymous / file.
    `mark(label)` ends a phase: its time and its own peak, the high-water mark reset after."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int]] = []
        self.marks: dict[str, tuple[float, int]] = {}
        self._hwm = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append(_resident())
            self._stop.wait(0.005)

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.reset = _reset_hwm()
        self.before, self.before_file = _resident()
        self._thread.start()
        self.mark("start")
        return self

    def mark(self, label: str) -> None:
        now = time.perf_counter()
        hwm = _status_kib("VmHWM") * 1024
        self._hwm = max(self._hwm, hwm)
        self.marks[label] = (now, hwm - self.before)
        _reset_hwm()

    def __exit__(self, *exc: object) -> None:
        self.mark("end")
        self._stop.set()
        self._thread.join()
        self.samples.append(_resident())

    def phases(self) -> tuple[dict[str, float], dict[str, int]]:
        """Each phase's seconds and peak growth, a phase being the span up to a mark."""
        labels = list(self.marks)
        times = {b: self.marks[b][0] - self.marks[a][0]
                 for a, b in zip(labels, labels[1:], strict=False)}
        return times, {b: self.marks[b][1] for b in labels[1:]}

    def result(self) -> dict[str, Any]:
        rss, file = max(self.samples)
        # Without a reset the high-water mark may predate the block: only the samples count.
        peak = max(self._hwm, rss) if self.reset else rss
        after = self.samples[-1][0]
        return {"rss_before": self.before, "peak_rss": peak, "growth": peak - self.before,
                "growth_sampled": rss - self.before, "hwm_reset": self.reset,
                "file_at_sampled_peak": file - self.before_file,
                "anon_at_sampled_peak": (rss - file) - (self.before - self.before_file),
                "growth_after": after - self.before, "samples": len(self.samples)}


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------- the model's files


def tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Every stored tensor's bytes, from the safetensors headers (their data offsets)."""
    sizes: dict[str, int] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, meta in header.items():
            if name != "__metadata__":
                begin, end = meta["data_offsets"]
                sizes[name] = end - begin
    return sizes


def warm_page_cache(model_dir: Path) -> None:
    for file in model_dir.glob("*.safetensors"):
        with open(file, "rb") as f:
            while f.read(1 << 24):
                pass


# ---------------------------------------------------------------------- stalwart's ranks


def _marked(fn: Any, mem: PeakRSS, name: str) -> Any:
    """fn, marking its start and end in mem."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mem.mark(f"{name}_start")
        try:
            return fn(*args, **kwargs)
        finally:
            mem.mark(f"{name}_end")
    return wrapper


def engine_config(world: int, model: str, data: str, cache: str) -> Any:
    """The config of the dist test of pretrained loading, FSDP2 over every rank."""
    from stalwart.core.config import load_config

    return load_config(None, [
        f"scaling.num_workers={world}", 'task.path="stalwart.tasks.hf:CausalLM"',
        f'task.args.model="{model}"', f'task.args.data="{data}"',
        "task.args.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.steps=4", "train.warmup_steps=1", "train.lr=1e-2",
        f'data.cache_dir="{cache}"', f"parallel.dp_shard={world}"])


def stalwart_rank(rank: int, world: int, model: str, data: str, cache: str) -> dict[str, Any]:
    """One rank: the task as a worker builds it, then the timed engine construction."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint.hf_storage  # noqa: F401 (load_weights' own import)

    from stalwart.core.task import build_task
    from stalwart.workers.engine import TrainEngine

    config = engine_config(world, model, data, cache)
    task = build_task(config.task.path, config.task.args)
    task.prepare_data(config)  # cached by the parent: opens the arrays' directory only
    mem = PeakRSS()
    task.build_model = _marked(task.build_model, mem, "build")
    task.init_weights = _marked(task.init_weights, mem, "load")
    dist.barrier()
    with mem:
        engine = TrainEngine(config, task, rank=rank, world_size=world,
                             device=torch.device("cpu"))
    local = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes
                for p in engine.model.parameters())
    seconds, peaks = mem.phases()
    # The spans up to each mark, named by the phase they hold.
    names = dict(zip(["build_start", "build_end", "load_start", "load_end", "end"], PHASES,
                     strict=True))
    return {"rank": rank, "phases_s": {names[k]: v for k, v in seconds.items()},
            "phase_peak_growth": {names[k]: v for k, v in peaks.items()},
            "to_loaded_s": sum(v for k, v in seconds.items() if k != "end"),
            "total_s": sum(seconds.values()), "local_param_bytes": local, **mem.result()}


# ---------------------------------------------------------------------- one-process baselines


def safetensors_process(model_dir: str, backend: str) -> dict[str, Any]:
    """load_file of every file into one dict of tensors. backend "pread" reads the bytes into
    the process's memory; "mmap" (the default) maps the files, and a page is read when a
    tensor first touches it."""
    import torch  # noqa: F401
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    with PeakRSS() as mem:
        start = time.perf_counter()
        tensors: dict[str, Any] = {}
        for file in files:
            tensors.update(load_file(str(file), backend=backend))
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "tensors": len(tensors), **mem.result()}


def from_pretrained_process(model_dir: str) -> dict[str, Any]:
    """AutoModelForCausalLM.from_pretrained, the whole model in one process; then every
    parameter read once, for the growth once the mapped files' pages are all in."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401 (code, not model memory)
    from transformers import AutoModelForCausalLM

    with PeakRSS() as mem:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
        seconds = time.perf_counter() - start
    with torch.no_grad():
        for param in model.parameters():
            param.sum()
    return {"seconds": seconds, "params": sum(p.numel() for p in model.parameters()),
            **mem.result(), "growth_touched": _resident()[0] - mem.before}


def in_fresh_process(fn: Any, *args: Any) -> dict[str, Any]:
    import multiprocessing as mp

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


# ---------------------------------------------------------------------- the bench


def make_files(work: Path, args: Any) -> dict[str, str]:
    from stalwart.core.task import build_task
    from tests.pretrained import make_chat_data, make_model_dir

    model = make_model_dir(work / "model", tie=not args.untied, max_shard=args.max_shard,
                           layers=args.layers, hidden=args.hidden)
    files = {"model": str(model), "data": str(make_chat_data(work / "chat.jsonl", 64)),
             "cache": str(work / "cache")}
    config = engine_config(1, files["model"], files["data"], files["cache"])
    build_task(config.task.path, config.task.args).prepare_data(config)  # before any rank
    warm_page_cache(model)
    return files


def one_round(rnd: int, files: dict[str, str], world: int) -> dict[str, Any]:
    runs = {
        "stalwart": lambda: {"ranks": common.gloo_world(
            stalwart_rank, world, files["model"], files["data"], files["cache"])},
        "safetensors": lambda: in_fresh_process(safetensors_process, files["model"], "pread"),
        "safetensors_mmap": lambda: in_fresh_process(safetensors_process, files["model"],
                                                     "mmap"),
        "from_pretrained": lambda: in_fresh_process(from_pretrained_process, files["model"]),
    }
    order = list(runs) if rnd % 2 == 0 else list(runs)[::-1]
    print(f"round {rnd + 1}: {' -> '.join(order)}", flush=True)
    return {name: runs[name]() for name in order}


def _median_of(rounds: list[dict[str, Any]], reader: str, key: str) -> float:
    return statistics.median(r[reader][key] for r in rounds)


def summarise(rounds: list[dict[str, Any]], model_bytes: int, largest: int,
              world: int) -> dict[str, Any]:
    """Medians over rounds; a world's time is its slowest rank's, its memory its largest."""
    ranks = [r["stalwart"]["ranks"] for r in rounds]

    def worst(get: Any) -> float:
        return statistics.median(max(get(x) for x in rs) for rs in ranks)

    st = {key: {p: worst(lambda x, p=p, key=key: x[key][p]) for p in PHASES}
          for key in ("phases_s", "phase_peak_growth")}
    st.update({k: worst(lambda x, k=k: x[k]) for k in (
        "to_loaded_s", "total_s", "growth", "growth_sampled", "anon_at_sampled_peak",
        "file_at_sampled_peak", "growth_after", "local_param_bytes")})
    st["load_phase_s"] = st["phases_s"]["load"]
    st["bytes_per_s"] = model_bytes / st["to_loaded_s"]
    st["bytes_per_s_load_phase"] = model_bytes / st["load_phase_s"]
    one = {name: {k: _median_of(rounds, name, k) for k in ("seconds", "growth")}
           for name in ("safetensors", "safetensors_mmap", "from_pretrained")}
    one["from_pretrained"]["growth_touched"] = _median_of(rounds, "from_pretrained",
                                                          "growth_touched")
    for row in one.values():
        row["bytes_per_s"] = model_bytes / row["seconds"]
    share = model_bytes / world
    bound = GOAL_RSS * share + largest
    baseline = one["safetensors"]["bytes_per_s"]
    return {"stalwart": st, **one, "share_bytes": share, "largest_tensor_bytes": largest,
            "rss_bound_bytes": bound, "rss_ratio": st["growth"] / (share + largest),
            "rss_goal_met": st["growth"] <= bound,
            "throughput_ratio": st["bytes_per_s"] / baseline,
            "throughput_ratio_load_phase": st["bytes_per_s_load_phase"] / baseline,
            "throughput_goal_met": st["bytes_per_s"] / baseline >= GOAL_THROUGHPUT}


def print_report(s: dict[str, Any], model_bytes: int, world: int) -> None:
    st, fp = s["stalwart"], s["from_pretrained"]

    def row(name: str, procs: int, seconds: float, growth: float | None) -> list[str]:
        return [name, str(procs), f"{seconds:.3f}", f"{model_bytes / 1e6 / seconds:,.0f}",
                "-" if growth is None else f"{growth / MIB:.1f}"]

    common.print_columns([
        ["reader", "processes", "time s", "MB/s", "peak RSS growth MiB (a process)"],
        row("stalwart FSDP2, start to loaded", world, st["to_loaded_s"], st["growth"]),
        row("stalwart, its load phase alone", world, st["load_phase_s"], None),
        row("safetensors load_file, pread", 1, s["safetensors"]["seconds"],
            s["safetensors"]["growth"]),
        row("safetensors load_file, mmap (lazy)", 1, s["safetensors_mmap"]["seconds"],
            s["safetensors_mmap"]["growth"]),
        row("from_pretrained", 1, fp["seconds"], fp["growth"])])
    print(f"\nfrom_pretrained, once every parameter has been read: "
          f"{fp['growth_touched'] / MIB:.1f} MiB over its start")
    print("stalwart's phases, slowest rank (s): " + ", ".join(
        f"{p} {st['phases_s'][p]:.3f}" for p in PHASES) + f"; engine total {st['total_s']:.3f}")
    print("stalwart's peak RSS growth by phase, largest rank (MiB): " + ", ".join(
        f"{p} {st['phase_peak_growth'][p] / MIB:.1f}" for p in PHASES))
    print(f"stalwart per rank: local parameters {st['local_param_bytes'] / MIB:.1f} MiB; peak "
          f"growth {st['growth'] / MIB:.1f} MiB (sampled {st['growth_sampled'] / MIB:.1f}: "
          f"anonymous {st['anon_at_sampled_peak'] / MIB:.1f}, file-backed "
          f"{st['file_at_sampled_peak'] / MIB:.1f}); {st['growth_after'] / MIB:.1f} MiB "
          f"held after")
    print(f"\nmemory: peak growth {st['growth'] / MIB:.1f} MiB against model/N "
          f"{s['share_bytes'] / MIB:.1f} + largest tensor {s['largest_tensor_bytes'] / MIB:.1f}"
          f" MiB: ratio {s['rss_ratio']:.3f}; goal <= {GOAL_RSS} x model/N + largest = "
          f"{s['rss_bound_bytes'] / MIB:.1f} MiB: {'MET' if s['rss_goal_met'] else 'NOT MET'}")
    print(f"throughput: stalwart / load_file (pread) = {s['throughput_ratio']:.3f} (its load "
          f"phase alone {s['throughput_ratio_load_phase']:.3f}); goal >= {GOAL_THROUGHPUT}: "
          f"{'MET' if s['throughput_goal_met'] else 'NOT MET'}")


def main() -> int:
    p = common.parser(__doc__, __spec__, "load.json")
    p.add_argument("--hidden", type=common.positive(), default=512,
                   help="hidden size of the Llama made (default 512)")
    p.add_argument("--layers", type=common.positive(), default=8,
                   help="its layers (default 8)")
    p.add_argument("--untied", action="store_true", help="an output head of its own")
    p.add_argument("--max-shard", default="20MB",
                   help="save_pretrained's max_shard_size (default 20MB)")
    p.add_argument("--world", type=common.positive(), default=2,
                   help="stalwart's ranks, FSDP2 over all (default 2)")
    p.add_argument("--rounds", type=common.positive(), default=3,
                   help="rounds in alternating order; medians are reported (default 3)")
    p.add_argument("--keep", action="store_true", help="keep the model directory")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-load-"))
    try:
        files = make_files(work, args)
        sizes = tensor_bytes(Path(files["model"]))
        model_bytes, largest = sum(sizes.values()), max(sizes.values())
        shards = len(list(Path(files["model"]).glob("*.safetensors")))
        print(f"load: Llama hidden {args.hidden}, {args.layers} layers: {len(sizes)} tensors, "
              f"{model_bytes / MIB:.1f} MiB fp32 in {shards} file(s), largest tensor "
              f"{largest / MIB:.2f} MiB; stalwart on {args.world} gloo ranks (FSDP2); "
              f"{args.rounds} round(s); files in {work}", flush=True)
        rounds = [one_round(rnd, files, args.world) for rnd in range(args.rounds)]
        summary = summarise(rounds, model_bytes, largest, args.world)
        print()
        print_report(summary, model_bytes, args.world)
        common.write_json(args.out, {
            "bench": "load", "time": time.time(),
            "goals": {"rss": f"growth <= {GOAL_RSS} x model/N + largest tensor",
                      "throughput": f">= {GOAL_THROUGHPUT} x safetensors load_file"},
            "model": {"hidden": args.hidden, "layers": args.layers, "tied": not args.untied,
                      "bytes": model_bytes, "largest_tensor_bytes": largest,
                      "tensors": len(sizes), "files": shards, "max_shard": args.max_shard},
            "world": args.world, "rounds": rounds, "summary": summary,
            "machine": common.machine(with_ray=False)})
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
