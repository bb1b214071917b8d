"""What ``decode.early_launch`` changes in a captured decode step, and what it saves.

An 8B-shaped model cut to ``--layers`` layers, 8 adapters of rank 16 on all seven projections,
patched with the defaults. For each batch size, greedy calls of ``--tokens`` tokens alternate
between early launch off and on, each capturing its decode graph afresh:

- the edges of the "on" graph, by (source kernel, destination kernel, edge type, source port),
  with the ones moved marked: ``<csv stem>_edges.csv``;
- the median GPU time of a step's replay, off and on (median over ``--rounds`` calls of each
  call's median), us a layer saved, and the calls' wall time a token: the CSV.

    python benchmarks/probe_early_launch.py --out benchmarks/results/probe_early_launch_h200.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _short(name):
    if name is None:
        return "(not a kernel)"
    return name if len(name) <= 70 else name[:67] + "..."


def _generate(model, ids, names, tokens):
    """One greedy call; (median replay ms of its decode steps, wall ms a token)."""
    import time

    import bench_generate as bg

    replays = bg.ReplayTimes()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with replays, torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                       max_new_tokens=tokens, do_sample=False)
    torch.cuda.synchronize()
    return replays.median_ms(), 1e3 * (time.perf_counter() - t0) / tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--out", default="benchmarks/results/probe_early_launch_h200.csv")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_early_launch needs a CUDA GPU; nothing measured")
        return 0
    import bench_generate as bg
    import peft_fastlora as fastlora
    from peft_fastlora.decode import early_launch

    bg.SHAPES["8b"] = dict(bg.SHAPES["8b"], num_hidden_layers=args.layers)
    model = bg.add_adapters(bg.build_base("8b"), 8, 16)
    print(fastlora.patch(model), flush=True)
    vers = bg.versions()
    rows, edge_rows = [], []
    for batch in args.batches:
        ids = torch.randint(3, 1000, (batch, 64), device="cuda")
        names = [f"a{i % 8}" for i in range(batch)]
        times = {False: [], True: []}
        for r in range(args.rounds + 1):  # round 0 warms up (compiles) and dumps the edges
            for on in (False, True):
                early_launch.ENABLED = on
                runner = fastlora.get_state(model).graph_runner
                if runner is not None:
                    runner.drop_graphs()  # captured again in this call, with early launch on or off
                replay_ms, wall_ms = _generate(model, ids, names, args.tokens)
                runner = fastlora.get_state(model).graph_runner
                stats = runner.stats
                if r == 0:
                    print(batch, "early launch", on, {k: stats[k] for k in ("captures", "early_edges",
                                                                             "early_launch_off")}, flush=True)
                else:
                    times[on].append((replay_ms, wall_ms))
            if r == 0:  # the "on" graph is the runner's now
                handle = list(runner.graphs.values())[-1]["graph"].raw_cuda_graph()
                kernel = early_launch.names(handle)
                count = collections.Counter()
                for e in early_launch.edges(handle):
                    count[(_short(kernel.get(e.src)), _short(kernel.get(e.dst)), e.type, e.from_port)] += 1
                for (src, dst, kind, port), n in sorted(count.items(), key=lambda kv: -kv[1]):
                    moved = kind == early_launch.TYPE_PROGRAMMATIC and port == early_launch.PORT_LAUNCH_ORDER
                    edge_rows.append(dict(batch=batch, src=src, dst=dst, type=kind, from_port=port, count=n,
                                          moved=moved))
                    print(f"  {n:4d} x type {kind} port {port}{' (moved)' if moved else ''}: {src} -> {dst}")
        early_launch.ENABLED = True
        med = {on: [statistics.median(t[i] for t in times[on]) for i in (0, 1)] for on in times}
        row = dict(batch=batch, layers=args.layers, tokens=args.tokens,
                   replay_off_ms=round(med[False][0], 4), replay_on_ms=round(med[True][0], 4),
                   saved_per_layer_us=round(1e3 * (med[False][0] - med[True][0]) / args.layers, 3),
                   wall_off_ms_per_token=round(med[False][1], 4), wall_on_ms_per_token=round(med[True][1], 4),
                   off_replays=" ".join(f"{t[0]:.4f}" for t in times[False]),
                   on_replays=" ".join(f"{t[0]:.4f}" for t in times[True]), **vers)
        print(row, flush=True)
        rows.append(row)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for data, path in ((rows, args.out), (edge_rows, os.path.splitext(args.out)[0] + "_edges.csv")):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(data[0]))
            w.writeheader()
            w.writerows(data)
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
