"""Per-kernel hardware counters of a graphed 8B decode step (#13), for Nsight Compute.

The timelines (``step_timeline.py``) say how long each kernel of a step takes; they cannot say why a
GEMM at 128 rows runs 1.3-2x its weight's byte time. This script gives Nsight Compute exactly one
decode step to profile: it builds the 8B shape with fewer layers (every layer is the same, so a few
show all of a step's kernels), patches it with CUDA graphs, warms ``generate`` up, then opens the
profiler range around the third and fourth graph replays of a second call. Run under ``ncu`` with
``--profile-from-start off --graph-profiling node``, each kernel node of those replays is profiled
alone (no PDL overlap, caches flushed by ``--cache-control all``): its DRAM bytes and throughput,
its L2 traffic, its SMs' activity.

    ncu --profile-from-start off --graph-profiling node --clock-control none --csv --page raw \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,... --log-file ncu_mixed_b128.csv \\
        python3 benchmarks/ncu_step.py --method mixed --batch 128 --layers 4
    python3 benchmarks/ncu_step.py --summarize ncu_mixed_b128.csv   # a table: one line a kernel

``--summarize`` reads the raw-page CSV of the metrics ``METRICS`` names (what the session-38 runs
collected) and prints, a kernel a line, its time, DRAM bytes and the bandwidth they make, its DRAM
and L2 throughput against peak, its L2 traffic and hit rate, and the fraction of the kernel's
cycles its SMs were active (ramp and tail show as idle).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402
import peft_fastlora as fastlora  # noqa: E402

PROFILED_REPLAYS = (3, 4)  # of the profiled call: past the first step's set-up, inside steady decode
METRICS = ("gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,"
           "dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,"
           "lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,"
           "sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,gpc__cycles_elapsed.max,"
           "sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__block_size,"
           "launch__registers_per_thread")


def summarize(path: str) -> list:
    """Lines of a table (one a kernel) from an ``ncu --csv --page raw`` log of ``METRICS``."""
    import csv

    def num(x):
        return float(x.replace(",", ""))

    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if line.startswith('"')))
    units, rows = rows[0], rows[1:]
    if units["gpu__time_duration.sum"] != "ns" or units["dram__bytes_read.sum"] != "byte":
        raise ValueError(f"{path}: units {units['gpu__time_duration.sum']} / {units['dram__bytes_read.sum']}, "
                         "expected ns / byte")
    out = [f"{'kernel':40s} {'us':>7s} {'DRAM MB':>8s} {'TB/s':>5s} {'DRAM%':>6s} {'L2 MB':>7s} {'L2%':>5s} "
           f"{'hit%':>5s} {'SM act':>6s} {'grid':>6s} {'regs':>4s}"]
    for r in rows:
        us = num(r["gpu__time_duration.sum"]) / 1e3
        dram = (num(r["dram__bytes_read.sum"]) + num(r["dram__bytes_write.sum"])) / 1e6
        active = num(r["sm__cycles_active.avg"]) / num(r["gpc__cycles_elapsed.max"])
        out.append(f"{r['Kernel Name'][:40]:40s} {us:7.2f} {dram:8.2f} {dram / us:5.2f} "
                   f"{num(r['dram__throughput.avg.pct_of_peak_sustained_elapsed']):6.1f} "
                   f"{num(r['lts__t_bytes.sum']) / 1e6:7.2f} "
                   f"{num(r['lts__throughput.avg.pct_of_peak_sustained_elapsed']):5.1f} "
                   f"{num(r['lts__t_sector_hit_rate.pct']):5.1f} {active:6.2f} "
                   f"{r['launch__grid_size'].replace(',', ''):>6s} {r['launch__registers_per_thread']:>4s}")
    return out


class ReplayWindow:
    """Opens the CUDA profiler range around the given replays (counted from ``arm``)."""

    def __init__(self, replays):
        self.replays, self.count, self.armed, self.opened = replays, 0, False, False
        self._orig = torch.cuda.CUDAGraph.replay
        window = self

        def replay(graph):
            if window.armed:
                window.count += 1
                if window.count == window.replays[0]:
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStart()
                    window.opened = True
            window._orig(graph)
            if window.armed and window.count == window.replays[-1] and window.opened:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                window.opened, window.armed = False, False

        torch.cuda.CUDAGraph.replay = replay

    def arm(self):
        self.count, self.armed = 0, True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=["base", "mixed"], default="mixed")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, emulated graphs: set-up only")
    p.add_argument("--summarize", nargs="+", metavar="CSV", help="print the table of these ncu logs and exit")
    args = p.parse_args(argv)
    if args.summarize:
        for path in args.summarize:
            print(f"== {path}")
            print("\n".join(summarize(path)))
        return 0
    shape = "tiny" if args.smoke else "8b"
    if args.smoke:
        bg.DEVICE = "cpu"
    bg.SHAPES["ncu"] = dict(bg.SHAPES[shape], num_hidden_layers=args.layers)
    model = bg.build_base("ncu")
    if args.method == "mixed":
        model = bg.add_adapters(model, 8, 16)
    print(fastlora.patch(model, cuda_graphs="emulate" if args.smoke else "auto"), flush=True)
    ids = torch.randint(3, 1000, (args.batch, args.prompt), device=bg.DEVICE)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
              max_new_tokens=8, min_new_tokens=8)
    if args.method == "mixed":
        kw["adapter_names"] = [f"a{i % 8}" for i in range(args.batch)]
    model.generate(**kw)  # compiled and captured outside the profiler range
    window = ReplayWindow(PROFILED_REPLAYS)
    window.arm()
    model.generate(**kw)
    if args.smoke:  # emulated graphs replay no CUDAGraph: no range to open on the CPU
        print(f"smoke: {args.method} batch {args.batch} built, patched and generated twice", flush=True)
        return 0
    print(f"{args.method} batch {args.batch}: {window.count} replays in the profiled call, "
          f"range {'closed' if not window.armed else 'never reached'}", flush=True)
    return 0 if not window.armed else 1


if __name__ == "__main__":
    sys.exit(main())
