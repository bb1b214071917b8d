"""The graphed decode step of two source trees, alternated on one GPU: does a change cost speed?

Each side is a folder holding a ``peft_fastlora`` package (a checkout of another commit, say, made
with ``git archive``). Every run is a fresh process that imports the package from its side's folder,
builds the random-weight model, and measures, with the public API alone (``patch``, ``generate``,
``unpatch``), the base model patched by fastlora and the PeftModel with ``--adapters`` adapters in
a round-robin mix, at each batch. Runs go A B B A (``--rounds`` times), so drift in clocks or
temperature falls on both sides alike. Per (side, method, batch): the median decode ms/step over
the runs and the median graph replay; the table gives new / old.

    git archive <commit> peft_fastlora | tar -x -C /tmp/old
    python benchmarks/bench_ab.py --old /tmp/old --new . --model 8b     # ab_8b_<gpu>.csv
    python benchmarks/bench_ab.py --old . --new . --smoke                # CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROW = "AB_ROW "


def run_side(args) -> None:
    """One process of one side: every method and batch, each measured row printed after ``ROW``."""
    sys.path.insert(0, os.path.abspath(args.tree))
    sys.path.insert(1, HERE)
    import harness as hx
    import peft_fastlora as fastlora
    import torch

    where = os.path.dirname(os.path.abspath(fastlora.__file__))
    assert where.startswith(os.path.abspath(args.tree)), f"imported {where}, not the side's tree {args.tree}"
    if args.smoke:
        hx.use_cpu()
    graphs = "emulate" if hx.DEVICE == "cpu" else "auto"
    model = hx.build_base(args.model)
    ids = {b: torch.randint(3, 1000, (b, args.prompt), device=hx.DEVICE) for b in args.batches}

    def kw(b, n):
        return dict(input_ids=ids[b], attention_mask=torch.ones_like(ids[b]), max_new_tokens=n,
                    min_new_tokens=n, do_sample=False, pad_token_id=0)

    def measure(target, method, names=None):
        fastlora.patch(target, cuda_graphs=graphs)
        for b in args.batches:
            extra = {} if names is None else dict(adapter_names=names[b])
            _, decode, _ = hx.measure(lambda n, b=b: target.generate(**kw(b, n), **extra), args.new_tokens, args.reps)
            print(ROW + json.dumps(dict(method=method, batch=b, decode_ms_per_step=decode,
                                        graph_replay_ms=hx.measure.replay_ms)), flush=True)
        fastlora.unpatch(target)

    measure(model, "base_patched")
    peft_model = hx.add_adapters(model, args.adapters, args.rank)
    measure(peft_model, "mixed", {b: hx.round_robin(b, args.adapters) for b in args.batches})


def side_rows(side: str, tree: str, args) -> list:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", tree, "--model", args.model,
           "--adapters", str(args.adapters), "--rank", str(args.rank), "--prompt", str(args.prompt),
           "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
           "--batches", *map(str, args.batches)] + (["--smoke"] if args.smoke else [])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the side's tree alone
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.side_limit)
    except subprocess.TimeoutExpired as e:  # its rows so far still count
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(f"{side} ({tree}) passed --side-limit {args.side_limit} s; keeping its finished rows", flush=True)
    else:
        if done.returncode != 0:
            raise RuntimeError(f"{side} ({tree}) failed:\n{done.stderr[-4000:]}")
        out = done.stdout
    return [dict(json.loads(line[len(ROW):]), side=side) for line in out.splitlines() if line.startswith(ROW)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", help="folder with the old side's peft_fastlora")
    p.add_argument("--new", help="folder with the new side's peft_fastlora")
    p.add_argument("--side", help=argparse.SUPPRESS)  # a child: measure this tree
    p.add_argument("--model", default="8b")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="A B B A, this many times")
    p.add_argument("--side-limit", type=int, default=400, help="seconds one side's process may take")
    p.add_argument("--out", default="benchmarks/results", help="folder for the CSV (empty: none written)")
    p.add_argument("--tag", default="", help="added to the file name")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script only")
    args = p.parse_args(argv)
    if args.side:
        args.tree = args.side
        run_side(args)
        return 0
    sys.path.insert(0, HERE)
    import harness as hx

    if not hx.start(args, "bench_ab"):
        return 0
    if args.smoke:
        args.model, args.batches, args.new_tokens, args.reps = "tiny", [2], 4, 1
    rows = []
    order = ("old", "new") if args.smoke else ("old", "new", "new", "old")  # a smoke run checks the script
    for _ in range(args.rounds):
        for side in order:
            rows += side_rows(side, getattr(args, side), args)
    vers = hx.versions()
    table = []
    for method in ("base_patched", "mixed"):
        for b in args.batches:
            got = {s: [r for r in rows if (r["side"], r["method"], r["batch"]) == (s, method, b)] for s in ("old", "new")}
            if not (got["old"] and got["new"]):  # a side ran out of time before this row
                continue
            med = {s: statistics.median(r["decode_ms_per_step"] for r in got[s]) for s in got}
            rep = {s: [r["graph_replay_ms"] for r in got[s] if r["graph_replay_ms"]] for s in got}
            rep = {s: statistics.median(v) if v else None for s, v in rep.items()}
            table.append(dict(**vers, model=hx.model_label(args.model), method=method, batch=b,
                              adapters=args.adapters if method == "mixed" else 0, runs_per_side=len(got["new"]),
                              old_ms=round(med["old"], 3), new_ms=round(med["new"], 3),
                              new_over_old=round(med["new"] / med["old"], 4) if med["old"] > 0 else "",
                              old_replay_ms=round(rep["old"], 3) if rep["old"] else "",
                              new_replay_ms=round(rep["new"], 3) if rep["new"] else "",
                              replay_new_over_old=round(rep["new"] / rep["old"], 4) if rep["old"] and rep["new"] else "",
                              old_runs_ms=" ".join(f"{r['decode_ms_per_step']:.3f}" for r in got["old"]),
                              new_runs_ms=" ".join(f"{r['decode_ms_per_step']:.3f}" for r in got["new"])))
    cols = ["method", "batch", "old_ms", "new_ms", "new_over_old", "old_replay_ms", "new_replay_ms",
            "replay_new_over_old", "old_runs_ms", "new_runs_ms"]
    print(" | ".join(cols))
    for r in table:
        print(" | ".join(str(r[c]) for c in cols))
    if args.out:
        stem = "_".join(x for x in ("ab", args.model, args.tag) if x)
        hx.write_csv(table, hx.out_path(args.out, stem, vers["gpu"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
