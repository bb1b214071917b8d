"""Probe (#14): the folded decode path's expand with each program taking several column blocks.

With the shrink folded into the base GEMM, decode runs only the expand after it
(``ops.lora_expand`` reading its shrink from the GEMM's columns, packed B). Its grid is one program
per (chunk, column block, module): with 64 distinct adapters in a batch of 64 that is thousands
of programs that each read a few KB after a chain of metadata loads. Here each program may take
``n_steps`` column blocks in a row. Timed per workload (32 layers of distinct arenas in one CUDA
graph, q/k/v and o of the 8B shape, bf16), over column tiles, steps and warps; every variant's
output must equal the library launch's.

    python benchmarks/probe_expand_steps.py --out benchmarks/results/probe_expand_steps_h200.csv
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402  (write_csv)

LAYERS = 32
SITES = {"qkv": (0, 4096, 5120, 6144), "o": (0, 4096)}
# name: (rows, adapters, ranks to draw from); rows are spread over the adapters round robin
WORKLOADS = {"64_distinct_mixed": (64, 64, [8, 16, 32, 64]), "32x8_r16": (32, 8, [16]),
             "128x32_mixed": (128, 32, [8, 16, 32, 64])}
VARIANTS = [(64, 1, 4), (128, 1, 4), (64, 2, 4), (64, 4, 4), (64, 8, 4), (128, 2, 4), (128, 4, 4), (128, 8, 4),
            (128, 4, 8), (256, 2, 4), (256, 4, 8)]  # (block_n, n_steps, num_warps)


def site_arenas(offsets, ranks, device, dtype, gen):
    """One layer's packed B arena and its tables for slots of these ranks (every module targeted)."""
    from peft_fastlora.backend.packed import block_align

    c = len(offsets) - 1
    n = len(ranks)
    a_rows = torch.zeros(n, c, dtype=torch.int32)
    b_offs = torch.zeros(n, c, dtype=torch.int64)
    row = off = 0
    for s, r in enumerate(ranks):
        for j in range(c):
            a_rows[s, j], b_offs[s, j] = row, off
            row += r
            off += (offsets[j + 1] - offsets[j]) * r
    b = torch.randn(off, generator=gen, device=device, dtype=dtype) * 0.02
    return b, a_rows.to(device), b_offs.to(device), row, block_align(ranks)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_expand_steps_h200.csv")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    from bench_kernels import Timer, capture, copy_bandwidth
    from peft_fastlora import ForwardBatch, get_backend
    from peft_fastlora.ops import lora_expand

    device, dtype = "cuda", torch.bfloat16
    timer = Timer(args.iters)
    bw = copy_bandwidth(timer)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows_out = []
    for wl in args.workloads:
        rows, adapters, choices = WORKLOADS[wl]
        rng, gen = random.Random(0), torch.Generator(device=device).manual_seed(0)
        ranks = [rng.choice(choices) for _ in range(adapters)]
        backend = get_backend("triton")(adapters, device)
        slots = [i % adapters for i in range(rows)]
        bi = backend.prepare_lora_batch(ForwardBatch.from_shape(rows, 1, device), slots, ranks, [1.0] * adapters,
                                        use_cuda_graph=False)
        plan = (bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len)
        layers, b_bytes = [], 0
        for _ in range(LAYERS):
            layer = {}
            for site, offsets in SITES.items():
                b, a_rows, b_offs, y_width, align = site_arenas(offsets, ranks, device, dtype, gen)
                c = len(offsets) - 1
                rt = torch.tensor([[r] * c for r in ranks], dtype=torch.int32, device=device)
                sc = torch.full((adapters, c), 0.5, dtype=torch.float32, device=device)
                y = torch.randn(rows, y_width, generator=gen, device=device, dtype=dtype)
                out = torch.randn(rows, offsets[-1], generator=gen, device=device, dtype=dtype)
                layer[site] = (y, b, offsets, rt, sc, out, b_offs, align, a_rows, max(ranks))
                used = {slots[i] for i in range(rows)}
                b_bytes += sum(ranks[s] * offsets[-1] * 2 for s in used)
            layers.append(layer)
        floor_us = b_bytes / LAYERS / bw * 1e6

        def run(variant, outs=None):
            for li, layer in enumerate(layers):
                for site, (y, b, offsets, rt, sc, out, b_offs, align, a_rows, r) in layer.items():
                    target = out if outs is None else outs[(li, site)]
                    kw = {} if variant is None else dict(block_n=variant[0], n_steps=variant[1], num_warps=variant[2])
                    lora_expand(y, b, offsets, rt, sc, target, *plan, block_m=bi.block_m, check=False,
                                b_offs=b_offs, b_align=align, y_cols=a_rows, max_rank=r, **kw)

        # the timed replays add into each layer's ``out`` in place: the checks start from a copy
        pristine = {(li, site): v[5].clone() for li, layer in enumerate(layers) for site, v in layer.items()}

        def fresh():
            return {k: v.clone() for k, v in pristine.items()}

        want = fresh()
        run(None, want)
        times = {}
        for variant in [None] + VARIANTS:
            name = "library" if variant is None else "n{}_s{}_w{}".format(*variant)
            got = fresh()
            run(variant, got)
            if any(not torch.equal(got[k], want[k]) for k in want):
                print(f"{wl} {name}: output differs from the library launch", flush=True)
                continue
            g = capture(lambda: run(variant))
            times[name] = timer(g.replay) / LAYERS
            del g
            rows_out.append(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                 triton=__import__("triton").__version__, copy_tb_s=round(bw / 1e12, 3),
                                 workload=wl, rows=rows, adapters=adapters, variant=name,
                                 block_n=variant[0] if variant else "", n_steps=variant[1] if variant else "",
                                 num_warps=variant[2] if variant else "", us_per_layer=round(times[name], 2),
                                 floor_us_per_layer=round(floor_us, 2), x_floor=round(times[name] / floor_us, 3),
                                 vs_library=round(times[name] / times["library"], 3)))
            print(f"{wl:20s} {name:14s} {times[name]:7.2f} us a layer (q/k/v + o), x{times[name] / floor_us:.2f} "
                  f"its B floor, x{times[name] / times['library']:.3f} the library", flush=True)
        layers = None
        torch.cuda.empty_cache()
    print("written", bg.write_csv(rows_out, os.path.dirname(args.out) or ".", os.path.basename(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
