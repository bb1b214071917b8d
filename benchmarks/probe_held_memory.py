"""Which CUDA allocations a sequence of ``generate`` calls leaves held, and from where.

Replays ``tests/test_graph_traffic_gpu.py::test_memory_bounded_over_a_random_sequence`` (the tiny
float32 Llama with six adapters, graph buckets warmed up, 40 random calls, every fourth one
sampling) with PyTorch's allocation history on; after each call it prints the memory allocated and,
for the blocks that appeared or went since the call before, their sizes and the fastlora /
transformers frames that allocated them. GPU only (the CUDA caching allocator's snapshots).

    python benchmarks/probe_held_memory.py [--calls 40]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def _held_blocks():
    return {b["address"]: b for seg in torch.cuda.memory._snapshot()["segments"] for b in seg["blocks"]
            if b["state"] == "active_allocated"}


def _frames(block, keep=8):
    ours = [f for f in block.get("frames", []) if any(k in f["filename"] for k in ("peft_fastlora", "transformers"))]
    return [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in ours[:keep]]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    import peft_fastlora as fastlora
    import test_graph_traffic_gpu as traffic

    torch.cuda.memory._record_memory_history(max_entries=200000)
    model = traffic._model()
    fastlora.patch(model, graph_buckets=[1, 2, 4, 8, 16, 24, 32, 48])
    fastlora.warmup(model, max_length=160)
    g = torch.Generator().manual_seed(60)  # the test's draws
    before, allocated = _held_blocks(), None
    for i in range(args.calls):
        rows, prompt, new = (int(torch.randint(1, hi, (1,), generator=g)) for hi in (40, 120, 30))
        if i == 0:
            rows, prompt, new = 39, 119, 29
        with torch.no_grad():
            model.generate(**traffic._inputs(rows, prompt, 100 + i), adapter_names=traffic._names(rows, i),
                           max_new_tokens=new, do_sample=bool(i % 4 == 0))
        torch.cuda.synchronize()
        now, held = torch.cuda.memory_allocated(), _held_blocks()
        grown = {a: b for a, b in held.items() if a not in before}
        gone = [a for a in before if a not in held]
        print(f"call {i}: rows {rows} prompt {prompt} new {new} {'sampling' if i % 4 == 0 else 'greedy'}: "
              f"allocated {now} ({now - (allocated or now):+d}); +{len(grown)} blocks "
              f"({sum(b['size'] for b in grown.values())} B), -{len(gone)}", flush=True)
        for b in list(grown.values())[:6]:
            print("   ", b["size"], _frames(b))
        before, allocated = held, now
    print("stats", fastlora.get_state(model).graph_runner.stats)


if __name__ == "__main__":
    main()
