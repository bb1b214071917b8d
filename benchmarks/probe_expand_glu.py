"""Probe (#13): a LoRA gate/up's expand and the gated activation, as two launches (``lora_expand``
then ``act_mul``: the decode step before) and as one (``ops.lora_expand_glu``) over column tiles
and warps.

8B's gate/up (2 x 14,336 outputs) with 8 adapters of rank 16, the shrink read from a folded GEMM's
columns, rows dealt round robin (every fifth with no adapter at 32 and 128 rows). Timed: 32 layers
of distinct arenas and outputs in one CUDA graph (no layer's data in L2 from the one before), bf16.
The floor is the bytes one launch must move (B of the adapters used, gate and up read, the product
written) at the measured copy bandwidth. Every variant's output is checked against the two
launches'.

    python benchmarks/probe_expand_glu.py --out benchmarks/results/probe_expand_glu_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402  (write_out)

LAYERS, N, ADAPTERS, RANK = 32, 14336, 8, 16
VARIANTS = [(64, 4), (128, 4), (128, 8), (256, 8)]  # (block_n, num_warps) of the one launch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_expand_glu_h200.csv")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_expand_glu needs a CUDA GPU; nothing measured")
        return 0
    from bench_kernels import capture, packed_layout, timer_and_bandwidth
    from peft_fastlora import ForwardBatch, get_backend
    from peft_fastlora.ops import act_mul, lora_expand
    from peft_fastlora.ops.lora_expand_glu import expand_glu_config, lora_expand_glu

    device, dtype = "cuda", torch.bfloat16
    timer, bw = timer_and_bandwidth(args.iters)
    offsets = (0, N, 2 * N)
    ranks = [RANK] * ADAPTERS
    a_rows, b_offs, arena_rows, b_size = packed_layout(offsets, ranks)
    a_rows, b_offs = a_rows.to(device), b_offs.to(device)
    rt = torch.full((ADAPTERS, 2), RANK, dtype=torch.int32, device=device)
    sc = torch.full((ADAPTERS, 2), 0.5, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows_out = []
    for m in args.rows:
        backend = get_backend("triton")(ADAPTERS, device)
        slots = [-1 if (i % 5 == 4 and m > 1) else i % ADAPTERS for i in range(m)]
        bi = backend.prepare_lora_batch(ForwardBatch.from_shape(m, 1, device), slots, ranks, [1.0] * ADAPTERS,
                                        use_cuda_graph=False)
        plan = (bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len)
        layers = []
        for _ in range(LAYERS):
            b = torch.randn(b_size, generator=gen, device=device, dtype=dtype) * 0.02
            full = torch.randn(m, 2 * N + arena_rows, generator=gen, device=device, dtype=dtype)
            layers.append((b, full, torch.empty(m, N, device=device, dtype=dtype)))
        used = len({s for s in slots if s >= 0})
        floor_us = (used * 2 * N * RANK * 2 + m * 2 * N * 2 + m * N * 2) / bw * 1e6

        def two_launches():
            outs = []
            for b, full, _ in layers:
                gu = full[:, :2 * N].clone() if capturing is None else capturing[id(full)]
                lora_expand(full[:, 2 * N:], b, offsets, rt, sc, gu, *plan, block_m=bi.block_m, check=False,
                            b_offs=b_offs, b_align=8, y_cols=a_rows, max_rank=RANK)
                outs.append(act_mul(gu[:, :N], gu[:, N:]))
            return outs

        def one_launch(block_n, num_warps):
            for b, full, out in layers:
                lora_expand_glu(full[:, 2 * N:], b, offsets, rt, sc, full, bi.token_slot, *plan, block_m=bi.block_m,
                                act="silu", b_offs=b_offs, b_align=8, y_cols=a_rows, max_rank=RANK, out=out,
                                block_n=block_n, num_warps=num_warps, check=False)
            return [out for _, _, out in layers]

        capturing = None
        want = [o.clone() for o in two_launches()]
        # the timed graph expands into scratch copies of gate/up (as the step's GEMM output would be)
        capturing = {id(full): full[:, :2 * N].clone() for _, full, _ in layers}
        timed = {"two_launches": timer(capture(two_launches).replay) / LAYERS}
        default = expand_glu_config(bi.block_m, RANK)
        for block_n, num_warps in VARIANTS:
            got = one_launch(block_n, num_warps)
            worst = max(((g.float() - w.float()).abs() / (w.float().abs() + 1e-2)).max().item()
                        for g, w in zip(got, want))
            name = f"one_n{block_n}_w{num_warps}"
            if worst > 2 ** -7:
                print(f"{m} rows {name}: output differs from the two launches' (relative {worst:.3g})", flush=True)
                continue
            timed[name] = timer(capture(lambda: one_launch(block_n, num_warps)).replay) / LAYERS
            if (block_n, num_warps) == (default["block_n"], default["num_warps"]):
                timed[name + "_default"] = timed[name]
        for name, us in timed.items():
            rows_out.append(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                 triton=__import__("triton").__version__, copy_tb_s=round(bw / 1e12, 3), rows=m,
                                 adapters_used=used, variant=name, us_per_layer=round(us, 2),
                                 floor_us_per_layer=round(floor_us, 2), x_floor=round(us / floor_us, 3),
                                 vs_two_launches=round(us / timed["two_launches"], 3)))
            print(f"{m:4d} rows {name:22s} {us:7.2f} us a layer, x{us / floor_us:.2f} its floor, "
                  f"x{us / timed['two_launches']:.3f} the two launches", flush=True)
        layers = capturing = None
        torch.cuda.empty_cache()
    return bg.write_out(rows_out, args.out)


if __name__ == "__main__":
    sys.exit(main())
