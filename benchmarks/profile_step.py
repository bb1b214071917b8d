"""Where a graphed decode step's time goes: the GPU's own timeline, the host's, or one step for Nsight
Compute.

``bench_generate`` reports a step (wall time of ``generate`` per token) and its replay (CUDA events
around ``CUDAGraph.replay``); this script says where each goes. Views (``--view``):

- ``timeline`` (default): one graphed ``generate`` call profiled with CUPTI, the GPU timeline of its
  steady steps split into ``graph_busy`` (kernels a ``cudaGraphLaunch`` launched, matched by
  correlation id), ``graph_gaps`` (idle time between a replay's first and last kernel),
  ``outside_busy`` (kernels and copies outside the graphs: token selection, input copies) and
  ``outside_idle`` (the GPU waiting between replays). On the host, between two graph launches:
  ``host_wait`` (blocking runtime calls) and ``host_busy`` (the rest); a host busy for about the
  GPU's period bounds the step. Inside a replay each kernel is charged the time by which it moved
  the replay's frontier (its run and the bubble before it; overlap under PDL not counted twice):
  ``profile_step_<model>_kernels.csv``, by kernel name and, for a kernel launched a few times a
  layer, by its place in the layer (``_stream_gemm_kernel[2/4]``: the third of four, gate/up).
- ``host``: the same call under cProfile, the functions with the most own and cumulative time;
  ``--sync-debug`` then counts each place that made the host wait for the GPU (CUDA's sync debug
  mode); ``--first-token`` profiles calls of one new token (prefill and set-up) instead.
- ``ncu``: the shape with ``--layers`` layers (every layer is alike), warmed up, then the CUDA
  profiler range opened around two graph replays of a second call: run it under ``ncu
  --profile-from-start off --graph-profiling node`` and each kernel node is profiled alone (DRAM
  bytes and throughput, L2 traffic, SM activity; ``METRICS``). ``--summarize CSV`` prints such a
  log a kernel a line.

``--methods``: ``base`` (the base model patched by fastlora, no adapters) and ``mixed`` (8 adapters
of rank 16, round-robin), each patched with its defaults and CUDA graphs.

    python benchmarks/profile_step.py --model 8b --batches 1 32 128 --out benchmarks/results
    python benchmarks/profile_step.py --view host --model 8b --batches 32 --sync-debug
    ncu --profile-from-start off --graph-profiling node --clock-control none --csv --page raw \\
        --metrics "$(python3 benchmarks/profile_step.py --print-metrics)" --log-file ncu_mixed_b128.csv \\
        python3 benchmarks/profile_step.py --view ncu --methods mixed --batches 128 --layers 4
    python benchmarks/profile_step.py --summarize ncu_mixed_b128.csv
"""

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402
import peft_fastlora as fastlora  # noqa: E402

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_events(call, cpu: bool = False):
    """(GPU activities as (start_us, end_us, name, correlation), correlation ids of graph launches,
    the host's CUDA runtime calls as (start_us, duration_us, name)). CUDA activity alone by default:
    recording CPU ops too slows the host, which widens the gaps measured."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=activities) as prof:
        call()
        hx.sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    gpu, graph_launches, runtime = [], set(), []
    for e in events:
        cat, args = e.get("cat", ""), e.get("args", {})
        if cat in ("cuda_runtime", "cuda_driver") and "dur" in e:
            runtime.append((float(e["ts"]), float(e["dur"]), e.get("name", "?")))
        if cat == "cuda_runtime" and e.get("name") == "cudaGraphLaunch":
            graph_launches.add(args.get("correlation"))
        elif cat in GPU_CATEGORIES and "dur" in e:
            gpu.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?"), args.get("correlation")))
    gpu.sort()
    if not graph_launches and not cpu:  # (a profiler that records the runtime calls with CPU ops only)
        return trace_events(call, cpu=True)
    return gpu, graph_launches, sorted(runtime)


def _waits(name: str) -> bool:
    """A runtime call in which the host waits for the GPU."""
    return "Synchronize" in name or (name.startswith("cudaMemcpy") and "Async" not in name)


def host_steps(runtime):
    """Per step on the host (between two graph launches, the same steps as ``split_steps``): the
    period, the time spent waiting for the GPU in blocking runtime calls, and the rest (the host's
    own work). A host busy for about the GPU's period is what bounds the step."""
    launches = [t for t, _, name in runtime if name == "cudaGraphLaunch"]
    steps = []
    for t0, t1 in zip(launches[2:-1], launches[3:]):
        wait = sum(d for t, d, name in runtime if t0 <= t < t1 and _waits(name))
        steps.append(dict(host_period=t1 - t0, host_wait=wait, host_busy=t1 - t0 - wait))
    return steps


def split_steps(gpu, graph_launches, layers=None):
    """Per replay (after the first two and before the last): a dict of the split, in microseconds
    (``layers``: see ``_charges``). A step's graph is one with at least half the kernels of the
    largest; smaller graphs (``step_advance``'s, between two steps) count as work outside."""
    replays = collections.defaultdict(list)  # correlation -> its kernels
    for start, end, name, corr in gpu:
        if corr in graph_launches:
            replays[corr].append((start, end, name))
    most = max((len(ks) for ks in replays.values()), default=0)
    step_launches = {corr for corr, ks in replays.items() if 2 * len(ks) >= most}
    spans = sorted((min(k[0] for k in ks), max(k[1] for k in ks), sorted(ks))
                   for corr, ks in replays.items() if corr in step_launches)
    steps = []
    for (s0, e0, kernels), (s1, _, _) in zip(spans[2:-1], spans[3:]):
        busy = _union(kernels)
        outside = [(a, b, name) for a, b, name, corr in gpu if corr not in step_launches and a >= e0 and b <= s1]
        out_busy = _union(outside)
        steps.append(dict(period=s1 - s0, graph_span=e0 - s0, graph_busy=busy, graph_gaps=(e0 - s0) - busy,
                          graph_kernels=len(kernels), outside_busy=out_busy, outside_idle=(s1 - e0) - out_busy,
                          outside=[(name, b - a) for a, b, name in outside], charges=_charges(kernels, layers)))
    return steps


def short_name(name: str) -> str:
    """A kernel's name without its template arguments, parameters and return type."""
    name = name.split("<")[0].split("(")[0].strip()
    return name.split(" ")[-1][:60]


def _charges(kernels, layers=None):
    """Per kernel name: (launches, time charged on the replay's frontier, own run time). With
    ``layers``, a kernel launched k times a layer (2 <= k <= 8) is also charged by its place in
    the layer, as ``name[i/k]`` (the streaming GEMM's four: q/k/v, o, gate/up, down)."""
    out = collections.defaultdict(lambda: [0, 0.0, 0.0])
    frontier = kernels[0][0] if kernels else 0.0
    launches = []  # (name, charged, own) in launch order
    for start, end, name in kernels:
        launches.append((short_name(name), max(0.0, end - frontier), end - start))
        frontier = max(frontier, end)
    for name, charged, own in launches:
        c = out[name]
        c[0], c[1], c[2] = c[0] + 1, c[1] + charged, c[2] + own
    if layers:
        counts = collections.Counter(name for name, _, _ in launches)
        seen = collections.Counter()
        for name, charged, own in launches:
            per_layer = counts[name] // layers
            if counts[name] % layers or not 2 <= per_layer <= 8:
                continue
            c = out[f"{name}[{seen[name] % per_layer}/{per_layer}]"]
            c[0], c[1], c[2] = c[0] + 1, c[1] + charged, c[2] + own
            seen[name] += 1
    return out


def kernel_rows(steps):
    """Rows of kernel name, launches a step, us charged a step, own us a step (mean over steps)."""
    total = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for s in steps:
        for name, (n, charged, own) in s["charges"].items():
            t = total[name]
            t[0], t[1], t[2] = t[0] + n, t[1] + charged, t[2] + own
    k = len(steps)
    rows = [dict(kernel=name, launches_per_step=round(n / k, 2), charged_us_per_step=round(c / k, 1),
                 own_us_per_step=round(o / k, 1)) for name, (n, c, o) in total.items()]
    return sorted(rows, key=lambda r: -r["charged_us_per_step"])


def _union(intervals) -> float:
    total, last = 0.0, None
    for a, b, _ in sorted(intervals):
        if last is None or a > last:
            total += b - a
            last = b
        elif b > last:
            total += b - last
            last = b
    return total


def summarise(steps, top: int, host=()):
    keys = ("period", "graph_span", "graph_busy", "graph_gaps", "outside_busy", "outside_idle")
    row = {f"{k}_us": round(statistics.median(s[k] for s in steps), 1) for k in keys}
    for k in ("host_period", "host_wait", "host_busy"):
        row[f"{k}_us"] = round(statistics.median(h[k] for h in host), 1) if host else ""
    row["graph_kernels"] = int(statistics.median(s["graph_kernels"] for s in steps))
    by_name = collections.Counter()
    for s in steps:
        for name, dur in s["outside"]:
            by_name[name[:80]] += dur / len(steps)
    row["outside_kernels_per_step"] = round(sum(len(s["outside"]) for s in steps) / len(steps), 1)
    row["top_outside"] = "; ".join(f"{name} {us:.1f}" for name, us in by_name.most_common(top))
    return row


# ---- host ------------------------------------------------------------------------------------------
def host_profile(gen, args) -> None:
    """cProfile of one call (``--first-token``: five calls of one new token), printed by own and by
    cumulative time; ``--sync-debug``: then where the host waited for the GPU in one more call."""
    _, step, _ = hx.measure(gen, args.new_tokens, 2)
    print(f"decode step {step:.3f} ms, replay (GPU) {hx.measure.replay_ms} ms", flush=True)
    calls, tokens = (5, 1) if args.first_token else (1, args.new_tokens)
    if args.first_token:
        t1, _, _ = hx.measure(gen, 2, 3)
        print(f"first token (a call of one new token) {t1:.2f} ms", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        gen(tokens)
        hx.sync()
    prof.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(f"# by {key}, {calls} call(s) of {tokens} new token(s)")
        print("\n".join(line[:180] for line in out.getvalue().splitlines()[5:]), flush=True)
    if args.sync_debug and hx.DEVICE == "cuda":
        print(f"# host waits for the GPU in one call of {args.new_tokens} new tokens (innermost frames outside torch)")
        for where, n in count_syncs(lambda: gen(args.new_tokens)).most_common(args.top):
            print(f"{n:6d}  {where}")


def count_syncs(call):
    """Run ``call`` with CUDA's sync debug mode warning, and count where each wait came from."""
    places = collections.Counter()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and "warnings" not in f.filename]
        places[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:][::-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
            hx.sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    return places


# ---- Nsight Compute -----------------------------------------------------------------------------------
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


# ---- the views --------------------------------------------------------------------------------------
def timeline(model, method, b, kw, args, rows, krows):
    gpu, launches, runtime = trace_events(lambda: model.generate(**kw))
    steps = split_steps(gpu, launches, model.config.num_hidden_layers)
    if not steps:
        print(f"batch {b}: no graph replays in the trace", flush=True)
        return
    row = dict(hx.versions(), model=args.model, method=method, stop_check=args.stop_check, batch=b, steps=len(steps), **summarise(steps, args.top, host_steps(runtime)))
    print(row, flush=True)
    rows.append(row)
    for r in kernel_rows(steps):
        krows.append(dict(model=args.model, method=method, batch=b, **r))
        if len(krows) <= 400 and r["charged_us_per_step"] >= 5:
            print("   ", r, flush=True)


def ncu_window(model, method, b, kw, args) -> bool:
    """The second call with the profiler range around two of its replays; whether it closed."""
    window = ReplayWindow(PROFILED_REPLAYS)
    window.arm()
    model.generate(**kw)
    if hx.DEVICE != "cuda":  # emulated graphs replay no CUDAGraph: no range to open on the CPU
        print(f"smoke: {method} batch {b} built, patched and generated twice", flush=True)
        return True
    print(f"{method} batch {b}: {window.count} replays in the profiled call, "
          f"range {'closed' if not window.armed else 'never reached'}", flush=True)
    return not window.armed


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--view", choices=["timeline", "host", "ncu"], default="timeline")
    p.add_argument("--model", default="8b", choices=sorted(hx.SHAPES))
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (--view ncu: 4)")
    p.add_argument("--methods", nargs="+", choices=["base", "mixed"], default=["base", "mixed"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--tag", default="", help="added to the CSVs' names")
    p.add_argument("--first-token", action="store_true", help="--view host: calls of one new token")
    p.add_argument("--sync-debug", action="store_true", help="--view host: count the host's waits for the GPU")
    p.add_argument("--summarize", nargs="+", metavar="CSV", help="print the table of these ncu logs and exit")
    p.add_argument("--print-metrics", action="store_true", help="print the metrics ncu is to collect and exit")
    p.add_argument("--stop-check", choices=["deferred", "per-step"], default="deferred",
                   help="per-step: patch(defer_stop_check=False), transformers' loop and its host work "
                        "between steps, for an A/B")
    hx.add_run_args(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.print_metrics:
        print(METRICS)
        return 0
    if args.summarize:
        for path in args.summarize:
            print(f"== {path}")
            print("\n".join(summarize(path)))
        return 0
    if not hx.start(args, "profile_step"):
        return 0
    if args.smoke:
        args.model, args.batches, args.new_tokens, args.top, args.prompt = "tiny", [2], 4, 5, 16
    layers = args.layers or (4 if args.view == "ncu" and not args.smoke else None)
    base = hx.build_base(args.model, layers)
    rows, krows, ok = [], [], True
    for method in args.methods:
        model = base if method == "base" else hx.add_adapters(base, 8, 16)
        print(method, fastlora.patch(model, cuda_graphs="auto" if hx.DEVICE == "cuda" else "emulate",
                                     defer_stop_check=args.stop_check == "deferred"), flush=True)
        for b in args.batches:
            ids = torch.randint(3, 1000, (b, args.prompt), device=hx.DEVICE)
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                      max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
            if method == "mixed":
                kw["adapter_names"] = hx.round_robin(b, 8)
            if args.view == "host":
                host_profile(lambda n, kw=kw: model.generate(**dict(kw, max_new_tokens=n, min_new_tokens=n)), args)
                continue
            model.generate(**kw)  # warm-up: compiled, captured
            if args.view == "ncu":
                ok = ncu_window(model, method, b, kw, args) and ok
            elif hx.DEVICE == "cuda":
                timeline(model, method, b, kw, args, rows, krows)
        fastlora.unpatch(model)
    if rows and args.out:
        stem = "_".join(x for x in ("profile_step", args.model, args.tag) if x)
        path = hx.write_csv(rows, hx.out_path(args.out, stem, rows[0]["gpu"]))
        hx.write_csv(krows, os.path.splitext(path)[0] + "_kernels.csv")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
