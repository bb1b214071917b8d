"""Where a graphed decode step's time goes on the GPU's own clock (#13): inside the graph, between
graphs, and idle.

``bench_generate`` reports a step (wall time of ``generate`` per token) and its replay (CUDA events
around ``CUDAGraph.replay``); the difference is whatever the GPU does, or waits for, between two
replays. This script profiles one graphed ``generate`` call with CUPTI and splits the GPU timeline
of its steady steps into:

- ``graph_busy``: kernels launched by a ``cudaGraphLaunch`` (matched by CUPTI's correlation id);
- ``graph_gaps``: idle time between the first and the last kernel of a replay (launch bubbles);
- ``outside_busy``: kernels and copies not launched by a graph (token selection, input copies);
- ``outside_idle``: idle time between one replay's end and the next one's start that no kernel
  fills (the GPU waiting for the host).

On the host, between two graph launches: ``host_wait`` (blocking runtime calls: synchronisations,
blocking copies) and ``host_busy`` (the rest). A host busy for about the GPU's period bounds the step.

Inside a replay each kernel is charged the time by which it moved the replay's frontier (its end
less the latest end before it): its run and the bubble before it, overlap under PDL not counted
twice. ``step_timeline_<model>_kernels.csv`` has that charge by kernel name, per step, and for a
kernel launched a few times a layer also by its place in the layer (``_stream_gemm_kernel[2/4]``:
the third of four, gate/up), so a GEMM's charge can be set against its weights' bytes.

Each row is per step (medians over the call's steady steps), with the most expensive kernels
outside the graphs. ``--base``: the model without adapters (``bench_generate``'s base rows).

    python benchmarks/step_timeline.py --model 8b --batches 1 32 --out benchmarks/results
"""

import argparse
import collections
import csv
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402
import peft_fastlora as fastlora  # noqa: E402
from peft_fastlora.base_ops import rotary_tables  # noqa: E402
from peft_fastlora.decode import deferred_stop, greedy_loop, step_advance  # noqa: E402

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_events(call, cpu: bool = False):
    """(GPU activities as (start_us, end_us, name, correlation), correlation ids of graph launches,
    the host's CUDA runtime calls as (start_us, duration_us, name)). CUDA activity alone by default:
    recording CPU ops too slows the host, which widens the gaps measured."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=activities) as prof:
        call()
        bg.sync()
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1b", choices=sorted(bg.SHAPES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", default=None, help="folder for step_timeline_<model>.csv")
    p.add_argument("--token-select", choices=["fused", "hf"], default="fused",
                   help="hf: transformers' token selection between steps (decode.greedy_loop.ENABLED), for an A/B")
    p.add_argument("--step-advance", choices=["on", "off"], default="on",
                   help="off: greedy steps' next inputs built on the host (decode.step_advance.ENABLED)")
    p.add_argument("--rotary-table", choices=["on", "off"], default="on",
                   help="off: graphs compute rotary cos/sin with the module (base_ops.rotary_tables.ENABLED)")
    p.add_argument("--step-record", choices=["on", "off"], default="on",
                   help="off: transformers' deferred stop check and the ids copy between greedy steps "
                        "(decode.deferred_stop.FLAG_CHECK)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script's set-up only")
    args = p.parse_args(argv)
    greedy_loop.ENABLED = args.token_select == "fused"
    step_advance.ENABLED = args.step_advance == "on"
    rotary_tables.ENABLED = args.rotary_table == "on"
    deferred_stop.FLAG_CHECK = args.step_record == "on"
    if args.smoke:
        bg.DEVICE, args.model, args.batches, args.new_tokens = "cpu", "tiny", [2], 4
    base = bg.build_base(args.model)
    rows, krows = [], []
    for method in ("base_graphs_attn", "fastlora_graphs"):
        model = base if method == "base_graphs_attn" else bg.add_adapters(base, 8, 16)
        print(method, fastlora.patch(model, cuda_graphs="auto" if bg.DEVICE == "cuda" else "emulate"), flush=True)
        for b in args.batches:
            ids = torch.randint(3, 1000, (b, 128), device=bg.DEVICE)
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                      max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
            if method == "fastlora_graphs":
                kw["adapter_names"] = [f"a{i % 8}" for i in range(b)]
            model.generate(**kw)  # warm-up: compiled, captured
            if bg.DEVICE != "cuda":
                continue
            gpu, launches, runtime = trace_events(lambda: model.generate(**kw))
            steps = split_steps(gpu, launches, base.config.num_hidden_layers)
            if not steps:
                print(f"batch {b}: no graph replays in the trace", flush=True)
                continue
            row = dict(bg.versions(), model=args.model, method=method, token_select=args.token_select,
                       step_advance=args.step_advance, rotary_table=args.rotary_table,
                       step_record=args.step_record, batch=b,
                       steps=len(steps),
                       **summarise(steps, args.top, host_steps(runtime)))
            print(row, flush=True)
            rows.append(row)
            for r in kernel_rows(steps):
                krows.append(dict(model=args.model, method=method, batch=b, **r))
                if len(krows) <= 400 and r["charged_us_per_step"] >= 5:
                    print("   ", r, flush=True)
        fastlora.unpatch(model)
    if rows and args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = (f"step_timeline_{args.model}" + ("_hf_select" if args.token_select == "hf" else "")
                + ("_host_inputs" if args.step_advance == "off" else "")
                + ("_no_rotary_table" if args.rotary_table == "off" else "")
                + ("_no_step_record" if args.step_record == "off" else ""))
        path = os.path.join(args.out, f"{stem}.csv")
        _write(path, rows)
        print("wrote", path)
        _write(os.path.join(args.out, f"{stem}_kernels.csv"), krows)
    return 0


def _write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
