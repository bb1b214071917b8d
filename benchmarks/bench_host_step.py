"""Host benchmark: fastlora's host work on one continuous-batching step's adapters.

An engine step hands fastlora its requests' adapters and token counts; before the forward is
launched fastlora checks that PEFT's adapters are as its stacks hold them and writes the step's
LoRA batch into the graphs' static buffers (``state.segments`` and the graph buffers' fill, what
``run_host_adapters_ms`` of ``bench_continuous.py`` times inside the engine). Where the engine's
thread sets the pace (the endpoint at high request rates), this time adds to every step. Inside
the engine, transformers' own work between two steps has left the CPU's caches holding other
data: ``--cold-mb`` reads that much before each step, and the checks then take several times
their time in a tight loop (they read a few facts from each of hundreds of layers).

The cost follows the counts (layers, projections, adapters, requests a step), not the widths, so
the model has the 8B layout's 32 layers and seven targeted projections at tiny widths, on the
device given (the GPU machine's host is what serving meets). The steps: ``--steps`` made-up ones
of 30-110 requests (``--requests``) drawn from the adapters by a Zipf law, two of them prefill
chunks.

    python benchmarks/bench_host_step.py                  # host_step_<gpu or cpu>.csv
    python benchmarks/bench_host_step.py --device cpu --out ""
    python benchmarks/bench_host_step.py --cold-mb 64      # each step after 64 MB of other reads
    PYTHONPATH=<another tree> python benchmarks/bench_host_step.py --tag before   # that tree's peft_fastlora
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=64, help="distinct made-up steps, each run --reps times")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--requests", type=int, nargs=2, default=[30, 110], metavar=("LO", "HI"),
                   help="requests a made-up step, drawn uniformly between these (the 2,000-request workload's "
                        "steps carry several hundred)")
    p.add_argument("--cold-mb", type=int, default=0,
                   help="read this many MB of Python objects and arrays before each step, as the engine's own "
                        "work between steps does, so that the step meets cold CPU caches (0: none)")
    p.add_argument("--tag", default="", help="in the file name: host_step_<tag>_<gpu or cpu>.csv")
    p.add_argument("--out", default=hx.RESULTS, help="folder for host_step_<gpu or cpu>.csv (empty: none)")
    return p.parse_args(argv)


def host_cpu() -> str:
    """The host CPU's model name (Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_evictor(megabytes: int):
    """A function that reads about ``megabytes`` MB: half in Python objects (what transformers'
    step building walks), half in a numpy array."""
    import numpy as np

    objects = [{"id": i, "tokens": [i]} for i in range(megabytes * 1024 * 1024 // 2 // 400)]
    array = np.ones(megabytes * 1024 * 1024 // 2 // 4, dtype=np.float32)

    def evict():
        total = 0
        for o in objects:
            total += o["id"]
        return total + float(array.sum())

    return evict


def made_up_steps(n: int, adapters: int, zipf: float, requests=(30, 110), seed: int = 0):
    """``n`` engine-like steps: (adapter names, tokens of each request)."""
    from peft_fastlora.batch import TokenSegments

    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        rows = rng.randint(*requests)
        names = [f"a{min(adapters, int(rng.paretovariate(zipf))) - 1}" for _ in range(rows)]
        lens = [1] * (rows - 2) + [rng.randint(20, 200), rng.randint(1, 60)]
        steps.append(TokenSegments(names, lens, sum(lens)))
    return steps


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        hx.use_cpu()
    import peft_fastlora as fastlora

    torch.manual_seed(0)
    with torch.device(args.device):
        base = hx.build_base("tiny", layers=args.layers)
    model = hx.add_adapters(base, args.adapters, args.rank)
    fastlora.patch(model)
    state = fastlora.get_state(model)
    steps = made_up_steps(args.steps, args.adapters, args.zipf, args.requests)
    buffers = state.backend.new_graph_buffers(max(257, max(len(s.names) for s in steps) + 1),
                                              max(2048, max(s.num_tokens for s in steps)),
                                              max_slots=state.registry.num_slots)

    def checks(seg):
        with state.segments(seg):
            pass

    def fill(seg):
        fb, slots = seg.forward_batch(state.registry.slots_for(seg.names), state.device)
        ranks = state.slots.slot_ranks()
        with state.backend.using_graph_buffers(buffers):
            return state.backend.prepare_lora_batch(fb, slots, ranks, [1.0] * len(ranks), use_cuda_graph=True)

    def step(seg):
        with state.segments(seg):
            with state.forward_context(fill(seg)):
                pass

    evict = cache_evictor(args.cold_mb) if args.cold_mb else (lambda: None)

    def per_step_ms(fn) -> float:
        for seg in steps[:8]:  # first calls build what later ones reuse
            fn(seg)
        times = []
        for _ in range(args.reps):
            spent = 0.0
            for seg in steps:
                evict()
                t = time.perf_counter()
                fn(seg)
                spent += time.perf_counter() - t
            times.append(1e3 * spent / len(steps))
        return round(statistics.median(times), 4)

    generation = state.generation
    row = dict(device=args.device, host_cpu=host_cpu(), tag=args.tag, cold_mb=args.cold_mb, layers=args.layers,
               adapters=args.adapters, rank=args.rank, steps=args.steps, reps=args.reps,
               mean_requests=round(statistics.mean(len(s.names) for s in steps), 1),
               mean_tokens=round(statistics.mean(s.num_tokens for s in steps), 1),
               step_ms=per_step_ms(step), checks_ms=per_step_ms(checks), fill_ms=per_step_ms(fill), **hx.versions())
    # the premise: nothing changed between steps, so no step rebuilt the stacks
    row["rebuilds"] = state.generation - generation
    if args.device != "cuda":
        row["gpu"] = "cpu"
    print(row, flush=True)
    if args.out:
        stem = f"host_step_{args.tag}_" if args.tag else "host_step_"
        hx.write_csv([row], os.path.join(args.out, f"{stem}{hx.gpu_tag(row['gpu'])}.csv"))
    return row


if __name__ == "__main__":
    main()
