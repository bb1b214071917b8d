"""The segmented LoRA expand at prefill sizes, over its launch parameters.

A prefill's expand reads and writes every output row of every LoRA site once: at 8 x 2k tokens it
is a pure stream over the output (the dot has the rank for its depth). This script times the
column-block launch (``ops.lora_expand``, ``wide=False``) for each row tile, column block, warp
count and stage count over the 8B layout's site widths (fused q/k/v, fused gate/up, o / down),
8 adapters of rank 16 in segments of 2k tokens, bf16, reports the achieved bandwidth (output
read and written, the shrink's output read) and checks each launch's result against torch. The
shrink at the same sizes is swept the same way over its K tile, warps and stages (rows of
``kernel`` "shrink": the input read once counted). ``expand_config`` / ``shrink_config``'s choice
is the row marked ``chosen``; ``--split-k`` also sweeps the shrink's K ranges per tile. Gate/up's
expand inside the activation's launch (``ops.glu_expand``, rows of ``kernel`` "glu_expand": the
base output and the shrink's output read, the activation's written) is swept over its row tile,
column block, warps and stages, beside the two launches it replaces at the library's row tile for
that many tokens (``kernel`` "expand_then_act_mul": ``expand_config``'s launch, then
``ops.act_mul``), its bytes counted the same way; its default launch is the row marked ``chosen``. Each
launch is timed on the GPU by events, the L2 flushed before each (``harness.GpuTimer``): at an
engine step's size a launch takes tens of microseconds, which the host's launch and a
synchronisation around it would otherwise swamp. ``--warm-l2`` times launches back to back
instead, their inputs left in L2 as in a model's step, where the kernel before wrote them.

    python benchmarks/sweep_expand.py                    # expand_sweep_<gpu>.csv
    python benchmarks/sweep_expand.py --kernels glu      # glu_expand_sweep_<gpu>.csv: 8B gate/up at 16k tokens
    python benchmarks/sweep_expand.py --kernels glu --tokens 1024 --segment 1 --adapters 32 --tag decode   # decode-like
    TRITON_INTERPRET=1 python benchmarks/sweep_expand.py --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--segment", type=int, default=2048, help="tokens of one adapter in a row")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--block-m", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    p.add_argument("--block-k", type=int, nargs="+", default=[64, 128, 256], help="the shrink's K tiles")
    p.add_argument("--shrink-stages", type=int, nargs="+", default=[2, 3])
    p.add_argument("--split-k", type=int, nargs="+", default=[1], help="the shrink's K ranges per tile")
    p.add_argument("--glu-block-n", type=int, nargs="+", default=[64, 128, 256], help="glu_expand's column blocks")
    p.add_argument("--kernels", nargs="+", choices=["expand", "shrink", "glu"], default=["expand", "shrink", "glu"],
                   help="which sweeps run (glu: glu_expand beside the expand then act_mul)")
    p.add_argument("--tag", default="", help="added to the CSV's name")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warm-l2", action="store_true", help="launches back to back, inputs left in L2 (column l2)")
    hx.add_run_args(p)
    return p.parse_args(argv)


def reference(y, b, offsets, scaling, out, token_slot):
    """``out`` plus each token's delta, in float32."""
    res = out.float().clone()
    r = b.shape[2]
    for slot in token_slot.unique().tolist():
        rows = (token_slot == slot).nonzero().squeeze(1)
        for j, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            res[rows, lo:hi] += scaling * (y[rows, j * r:(j + 1) * r].float() @ b[slot, lo:hi].float().T)
    return res


def main(argv=None) -> int:
    args = parse_args(argv)
    if not hx.start(args, "sweep_expand"):
        return 0
    from peft_fastlora.batch import plan_chunks
    from peft_fastlora.ops import expand_config, lora_expand, lora_shrink
    from peft_fastlora.ops.lora_shrink import shrink_config

    hidden, kv, inter = 4096, 1024, 14336
    dtype = torch.bfloat16
    if args.smoke:  # tiny widths and one launch for Triton's interpreter
        hidden, kv, inter, dtype = 32, 8, 64, torch.float32
        args.tokens, args.segment, args.block_m, args.block_n, args.warps, args.stages, args.reps = \
            64, 16, [16], [32], [4], [1], 1
        args.block_k, args.shrink_stages, args.glu_block_n = [32], [2], [32]
    dev, vers = hx.DEVICE, hx.versions()
    gpu_us = hx.GpuTimer(args.reps, warm_l2=args.warm_l2)
    vers = dict(l2="warm" if args.warm_l2 else "flushed", **vers)
    sites = {"qkv": [0, hidden, hidden + kv, hidden + 2 * kv], "gate_up": [0, inter, 2 * inter], "o": [0, hidden]}
    seg_lens = [args.segment] * (args.tokens // args.segment)
    slots = [i % args.adapters for i in range(len(seg_lens))]
    token_slot = torch.tensor(slots, device=dev).repeat_interleave(args.segment)
    scaling, rows = 0.5, []
    torch.manual_seed(0)
    for site, offsets in sites.items() if "expand" in args.kernels else ():
        c, n = len(offsets) - 1, offsets[-1]
        b = torch.randn(args.adapters, n, args.rank, device=dev, dtype=dtype) * 0.05
        y = torch.randn(args.tokens, c * args.rank, device=dev, dtype=dtype)
        out0 = torch.randn(args.tokens, n, device=dev, dtype=dtype)
        ranks = torch.full((args.adapters, c), args.rank, dtype=torch.int32, device=dev)
        scalings = torch.full((args.adapters, c), scaling, dtype=torch.float32, device=dev)
        want = reference(y, b, offsets, scaling, out0, token_slot)
        gbytes = (2 * out0.numel() + y.numel()) * out0.element_size() / 1e9
        for block_m in args.block_m:
            plan = [torch.as_tensor(a, dtype=torch.int32, device=dev)
                    for a in plan_chunks(slots, seg_lens, block_m)[1:5]]
            chosen = expand_config(block_m, args.rank, max(hi - lo for lo, hi in zip(offsets[:-1], offsets[1:])))
            for block_n, warps, stages in itertools.product(args.block_n, args.warps, args.stages):
                out = out0.clone()
                run = lambda: lora_expand(y, b, offsets, ranks, scalings, out, *plan, block_m=block_m,  # noqa: E731
                                          block_n=block_n, num_warps=warps, num_stages=stages, wide=False)
                run()  # once: compiled, and the result to check
                err = (out.float() - want).abs().max().item()
                ms = gpu_us(run) / 1e3
                rows.append(dict(kernel="expand", site=site, tokens=args.tokens, width=n, block_m=block_m, block_n=block_n,
                                 num_warps=warps, num_stages=stages, ms=round(ms, 4),
                                 tb_per_s=round(gbytes / ms, 3), max_abs_err=err,
                                 chosen=(block_n, warps, stages) == (chosen["block_n"], chosen["num_warps"],
                                                                     chosen["num_stages"]), **vers))
                print({k: rows[-1][k] for k in ("site", "block_m", "block_n", "num_warps", "num_stages", "ms",
                                                "tb_per_s", "max_abs_err", "chosen")}, flush=True)
    for site, k, c in (("qkv", hidden, 3), ("gate_up", hidden, 2), ("down", inter, 1)) if "shrink" in args.kernels else ():
        a = torch.randn(args.adapters, c * args.rank, k, device=dev, dtype=dtype) * 0.05
        x = torch.randn(args.tokens, k, device=dev, dtype=dtype)
        ranks = torch.full((args.adapters, c), args.rank, dtype=torch.int32, device=dev)
        want = torch.empty(args.tokens, c * args.rank, device=dev)
        for slot in token_slot.unique().tolist():
            rows_of = (token_slot == slot).nonzero().squeeze(1)
            want[rows_of] = x[rows_of].float() @ a[slot].float().T
        gbytes = x.numel() * x.element_size() / 1e9
        for block_m in args.block_m:
            plan = [torch.as_tensor(p, dtype=torch.int32, device=dev)
                    for p in plan_chunks(slots, seg_lens, block_m)[1:5]]
            chosen = shrink_config(block_m, args.rank, k)
            for block_k, warps, stages, split in itertools.product(args.block_k, args.warps, args.shrink_stages,
                                                                   args.split_k):
                run = lambda: lora_shrink(x, a, c, ranks, *plan, block_m=block_m, block_k=block_k,  # noqa: E731
                                          num_warps=warps, num_stages=stages, split_k=split)
                err = (run().float() - want).abs().max().item()
                ms = gpu_us(run) / 1e3
                rows.append(dict(kernel="shrink", site=site, tokens=args.tokens, width=k, block_m=block_m,
                                 block_k=block_k, num_warps=warps, num_stages=stages, split_k=split,
                                 ms=round(ms, 4), tb_per_s=round(gbytes / ms, 3), max_abs_err=err,
                                 chosen=(min(block_k, k), warps, stages, split) == tuple(
                                     chosen[f] for f in ("block_k", "num_warps", "num_stages", "split_k")), **vers))
                print({f: rows[-1][f] for f in ("kernel", "site", "block_m", "block_k", "num_warps", "num_stages",
                                                "split_k", "ms", "tb_per_s", "max_abs_err", "chosen")}, flush=True)
    if "glu" in args.kernels:
        rows += sweep_glu(args, inter, dtype, slots, seg_lens, token_slot, scaling, gpu_us, vers)
    if args.out:  # (glu_expand alone: a file of its own)
        stem = "glu_expand_sweep" if args.kernels == ["glu"] else "expand_sweep"
        hx.write_csv(rows, hx.out_path(args.out, "_".join(x for x in (stem, args.tag) if x), vers["gpu"]))
    return 0


def sweep_glu(args, n, dtype, slots, seg_lens, token_slot, scaling, gpu_us, vers) -> list:
    """``ops.glu_expand`` over its launch parameters at gate/up's width ``n``, and the two launches
    it replaces (the expand at ``expand_config``'s launch for the library's row tile, then
    ``act_mul``), each checked against torch before it is timed; and ``act_mul`` alone. A launch
    that does not compile for the chip gets a row saying why."""
    from peft_fastlora.batch import choose_block_m, plan_chunks
    from peft_fastlora.ops import act_mul, act_mul_reference, glu_expand, glu_expand_reference, lora_expand
    from peft_fastlora.ops.glu_expand import BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS

    dev, r, rows = hx.DEVICE, args.rank, []
    align = 8 if r % 8 == 0 else 1
    b = torch.randn(args.adapters, 2 * n, r, device=dev, dtype=dtype) * 0.05
    # the packed arena as the pool lays it out: each (slot, module) block (n, rank), one after the other
    arena = torch.cat([b[sl, j * n:(j + 1) * n].reshape(-1) for sl in range(args.adapters) for j in range(2)])
    b_offs = (torch.arange(2 * args.adapters, device=dev, dtype=torch.int64) * n * r).view(args.adapters, 2)
    y = torch.randn(args.tokens, 2 * r, device=dev, dtype=dtype)
    gate_up = torch.randn(args.tokens, 2 * n, device=dev, dtype=dtype)
    ranks = torch.full((args.adapters, 2), r, dtype=torch.int32, device=dev)
    scalings = torch.full((args.adapters, 2), scaling, dtype=torch.float32, device=dev)
    slot_of = token_slot.to(torch.int32)
    want = glu_expand_reference(y, arena, b_offs, ranks, scalings, slot_of, gate_up, max_rank=r, b_align=align).float()
    gbytes = (gate_up.numel() + args.tokens * n + y.numel()) * gate_up.element_size() / 1e9
    default = dict(block_m=BLOCK_M, block_n=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES)

    def record(kernel, run, expected=want, **launch):
        try:
            err = (run().float() - expected).abs().max().item()
            ms = gpu_us(run) / 1e3
        except Exception as e:  # noqa: BLE001 - a launch that does not fit the chip: its row says why
            err, ms = None, None
            launch["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(dict(kernel=kernel, site="gate_up", tokens=args.tokens, segment=args.segment,
                         adapters=args.adapters, width=2 * n, **launch, ms=ms and round(ms, 4),
                         tb_per_s=ms and round(gbytes / ms, 3), max_abs_err=err, **vers))
        print({k: rows[-1].get(k) for k in ("kernel", "block_m", "block_n", "num_warps", "num_stages", "ms",
                                            "tb_per_s", "max_abs_err", "chosen", "error")}, flush=True)

    block_m = choose_block_m(args.tokens)
    plan = [torch.as_tensor(a, dtype=torch.int32, device=dev) for a in plan_chunks(slots, seg_lens, block_m)[1:5]]
    work = gate_up.clone()  # the expand adds into it: the first call's result is checked, the rest timed

    def two_launches():
        lora_expand(y, arena, [0, n, 2 * n], ranks, scalings, work, *plan, block_m=block_m, b_offs=b_offs,
                    b_align=align)
        return act_mul(work[:, :n], work[:, n:])

    record("expand_then_act_mul", two_launches, block_m=block_m, chosen=False)
    # the activation alone (no deltas), the speed those bytes allow
    record("act_mul", lambda: act_mul(gate_up[:, :n], gate_up[:, n:]), chosen=False,
           expected=act_mul_reference(gate_up[:, :n], gate_up[:, n:]).float())
    for bm, bn, warps, stages in itertools.product(args.block_m, args.glu_block_n, args.warps, args.stages):
        launch = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        record("glu_expand", lambda launch=launch: glu_expand(y, arena, b_offs, ranks, scalings, slot_of, gate_up,
                                                              max_rank=r, b_align=align, **launch),
               **launch, chosen=launch == default)
    return rows


if __name__ == "__main__":
    sys.exit(main())
