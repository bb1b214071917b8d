"""Probe (#13, batch 128): down_proj's LoRA shrink computed in gate/up's launch, so that down keeps
the base model's GEMM.

At 65-128 rows a folded LoRA down_proj runs one TMA GEMM over ``[W; A]`` (its residual add riding
along) and then the expand. The base model's down runs cuBLAS and a separate add. Session 30's
timeline put the LoRA site about 5 us a layer over the base one, with the fold's extra rows
costing about 1 of those. Here each gated tile of gate/up's launch (the prototype of
``probe_glu_hidden_shrink.py``, ``down=``) also multiplies its act-mul output tile, which is 128 of
down's K, by the same columns of down's A arena. It adds that partial shrink to a float32
(M, R_down) sum with atomic adds; the launch's shrink programs zero the sum first, and the count the
tiles wait on orders the two. Down then runs as the base model's does, cuBLAS (``F.linear`` and the
add, or ``addmm``). The sum is rounded to the activations' dtype, as PEFT rounds lora_A's output,
and the library's expand adds the deltas.

Timed as the other glu probes time (32 layers of distinct weights in one CUDA graph, each after an
RMSNorm), per layer: gate/up and down together, each way, and each part alone. Each way's down
output is checked against float32 math from the same bf16 act-mul output.

    python benchmarks/probe_down_shrink_in_glu.py --out benchmarks/results/probe_down_shrink_in_glu_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import bench_generate as bg  # noqa: E402
import probe_glu_hidden_shrink as pg  # noqa: E402


def down_operands(n_out, k, ranks, rows, device, dtype, gen):
    """One layer's LoRA down_proj as the library packs a folded site (one module): ``[W; A]`` with
    each slot's A rows at ``a_rows``, B flat at ``b_offs`` (readable past its end), and the buffers
    both ways write."""
    from bench_kernels import packed_layout

    a_rows, b_offs, t_rows, b_len = packed_layout((0, n_out), ranks)
    ext = torch.empty(n_out + t_rows, k, device=device, dtype=dtype)
    ext[:n_out].normal_(generator=gen).mul_(k ** -0.5)
    b_flat = torch.zeros(b_len + 64, device=device, dtype=dtype)[:b_len]
    for s, r in enumerate(ranks):
        ext[n_out + a_rows[s, 0]: n_out + a_rows[s, 0] + r] = (
            torch.randn(r, k, generator=gen, device=device, dtype=dtype) * k ** -0.5)
        b_flat[b_offs[s, 0]: b_offs[s, 0] + n_out * r] = (
            torch.randn(n_out * r, generator=gen, device=device, dtype=dtype) * r ** -0.5)
    bt = torch.zeros(n_out, t_rows, device=device, dtype=dtype)  # every slot's B as columns
    for s, r in enumerate(ranks):
        bt[:, a_rows[s, 0]: a_rows[s, 0] + r] = b_flat[b_offs[s, 0]: b_offs[s, 0] + n_out * r].view(n_out, r)
    return dict(ext=ext, w=ext[:n_out], a=ext[n_out:], b_flat=b_flat, a_rows=a_rows.to(device),
                wk=torch.cat([ext[:n_out], bt], dim=1),  # down folded along K: [W | B]
                hk=torch.empty(rows, k + t_rows, device=device, dtype=dtype),  # [h | rounded shrink]
                b_offs=b_offs.to(device), y=torch.empty(rows, n_out + t_rows, device=device, dtype=dtype),
                ds=torch.zeros(rows, t_rows, device=device, dtype=torch.float32),
                ds_rounded=torch.empty(rows, t_rows, device=device, dtype=dtype),
                out=torch.empty(rows, n_out, device=device, dtype=dtype))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pg.probe_arguments(p, "benchmarks/results/probe_down_shrink_in_glu_h200.csv")
    args = p.parse_args(argv)
    from bench_kernels import capture
    from peft_fastlora.base_ops.stream_linears import ADD_TILES
    from peft_fastlora.ops.lora_expand import lora_expand
    from peft_fastlora.ops.rms_norm import rms_norm
    from peft_fastlora.ops.stream_gemm import StreamWorkspace
    from peft_fastlora.ops.tma_gemm import TmaConfig, tma_gemm

    setup = pg.probe_setup(args, "probe_down_shrink_in_glu")
    if setup is None:
        return 0
    device, dtype, k, n, layers, rows = setup.device, setup.dtype, setup.k, setup.n, setup.layers, setup.rows
    timer, vers, cfg = setup.timer, setup.vers, setup.cfg
    # the library's folded down with the add (a split-K tile of the CPU's size under --smoke)
    deep_cfg = TmaConfig(16, 16, 2, 4, 2) if args.smoke else TmaConfig(**ADD_TILES["deep"][0])
    mb = pg.mixed_batch(args, rows, device)
    ranks, bi, plan = mb.ranks, mb.bi, mb.plan
    col_slot, col_scale, row_slot, counters = mb.col_slot, mb.col_scale, mb.row_slot, mb.counters
    gen = torch.Generator(device=device).manual_seed(0)
    gu = [pg.layer_operands(k, n, ranks, rows, device, dtype, gen) for _ in range(layers)]
    dn = [down_operands(k, n, ranks, rows, device, dtype, gen) for _ in range(layers)]
    x = torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
    residual = torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
    norm_w = torch.ones(k, device=device, dtype=dtype)
    rt = torch.tensor([[r] for r in ranks], dtype=torch.int32, device=device)
    sc = torch.tensor([[v] for v in mb.scalings], dtype=torch.float32, device=device)
    workspace = StreamWorkspace(device, 1 << 22, 1 << 12)
    align = 8 if args.rank % 8 == 0 else 1

    def expand(o, shrink, out):
        return lora_expand(shrink, o["b_flat"], (0, k), rt, sc, out, *plan, block_m=bi.block_m, check=False,
                           b_offs=o["b_offs"], b_align=align, y_cols=o["a_rows"], max_rank=args.rank)

    def gate_up(o, xn, d=None, own=False, k_fold=False):  # the prototype launch, with down's shrink (d)
        # or without; own: only each row's own slot's sums (down has one module: its columns' slots
        # are gate's); k_fold: the sum scaled and rounded into d["hk"]'s last columns by the last tile
        down = None if d is None else (d["a"], d["ds"], col_slot, k_fold) if own or k_fold else (d["a"], d["ds"])
        out = d["hk"][:, :n] if k_fold else o["h"]
        pg.glu_hidden_shrink(xn, o["w"], o["a_tail"], o["b_tail"], o["s"], out, row_slot, col_slot,
                             col_scale, counters, cfg, down=down)
        return d["hk"] if k_fold else out

    def down_k_fold(d, hk, addmm=True):  # one cuBLAS GEMM over [h | s] and [W | B]: base and LoRA
        if addmm:
            return torch.addmm(residual, hk, d["wk"].T, out=d["out"])
        return torch.add(residual, torch.nn.functional.linear(hk, d["wk"]), out=d["out"])

    def down_library(d, h):  # what the library runs today: [W; A] with the add, then the expand
        y = tma_gemm(h, d["ext"], out=d["y"], config=deep_cfg, workspace=workspace, check=False, add=residual)
        expand(d, y[:, k:], y[:, :k])
        return y[:, :k]

    def down_after(d, h, addmm=False):  # the base model's GEMM; the shrink from gate/up's launch
        out = torch.addmm(residual, h, d["w"].T, out=d["out"]) if addmm else torch.add(
            residual, torch.nn.functional.linear(h, d["w"]), out=d["out"])
        d["ds_rounded"].copy_(d["ds"])  # (PEFT rounds lora_A's output to the activations' dtype)
        return expand(d, d["ds_rounded"], out)

    def norm():
        return rms_norm(x, norm_w, 1e-5)

    variants = {
        "both, today: gate/up one launch (prototype); down [W; A] TMA + add, expand":
            lambda: [down_library(d, gate_up(o, norm())) for o, d in zip(gu, dn)],
        "both: gate/up with down's shrink; down F.linear + add, round, expand":
            lambda: [down_after(d, gate_up(o, norm(), d)) for o, d in zip(gu, dn)],
        "both: gate/up with down's shrink; down addmm, round, expand":
            lambda: [down_after(d, gate_up(o, norm(), d), addmm=True) for o, d in zip(gu, dn)],
        "both: gate/up with down's shrink, own slot's sums; down addmm, round, expand":
            lambda: [down_after(d, gate_up(o, norm(), d, own=True), addmm=True) for o, d in zip(gu, dn)],
        "both: gate/up with down's shrink rounded by its last tile; down addmm over [W | B]":
            lambda: [down_k_fold(d, gate_up(o, norm(), d, k_fold=True)) for o, d in zip(gu, dn)],
        "both: gate/up with down's shrink rounded by its last tile; down F.linear over [W | B] + add":
            lambda: [down_k_fold(d, gate_up(o, norm(), d, k_fold=True), False) for o, d in zip(gu, dn)],
        "part: gate/up alone (prototype)": lambda: [gate_up(o, norm()) for o in gu],
        "part: gate/up with down's shrink": lambda: [gate_up(o, norm(), d) for o, d in zip(gu, dn)],
        "part: gate/up with down's shrink, own slot's sums": lambda: [gate_up(o, norm(), d, own=True)
                                                                      for o, d in zip(gu, dn)],
        "part: down [W; A] TMA + add, expand (today)": lambda: [down_library(d, o["h"]) for o, d in zip(gu, dn)],
        "part: down F.linear + add, round, expand": lambda: [down_after(d, o["h"]) for o, d in zip(gu, dn)],
        "part: down addmm, round, expand": lambda: [down_after(d, o["h"], True) for o, d in zip(gu, dn)],
        "part: gate/up with down's shrink rounded by its last tile": lambda: [gate_up(o, norm(), d, k_fold=True)
                                                                              for o, d in zip(gu, dn)],
        "part: down addmm over [W | B]": lambda: [down_k_fold(d, d["hk"]) for d in dn],
        "part: down F.linear over [W | B] + add": lambda: [down_k_fold(d, d["hk"], False) for d in dn],
        "part: down addmm (the base model's W)": lambda: [torch.addmm(
            residual, o["h"], d["w"].T, out=d["out"]) for o, d in zip(gu, dn)],
        "part: down F.linear + add (the base model's)": lambda: [torch.add(
            residual, torch.nn.functional.linear(o["h"], d["w"]), out=d["out"]) for o, d in zip(gu, dn)],
    }

    def exact_down(o, d):  # float32 math from the first layer's bf16 act-mul output
        h = o["h"].float()
        s = h @ d["a"].float().T
        keep = (row_slot[:, None] == col_slot[None, :]) & (row_slot[:, None] >= 0)
        s = torch.where(keep, s * col_scale[None, :], 0.0)
        bt = torch.zeros(k, s.shape[1], device=device)
        for sl, r in enumerate(ranks):
            first, off = int(d["a_rows"][sl, 0]), int(d["b_offs"][sl, 0])
            bt[:, first: first + r] = d["b_flat"][off: off + k * r].view(k, r).float()
        return h @ d["w"].float().T + residual.float() + s @ bt.T

    rows_out = []
    for name, fn in variants.items():
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - one variant's failure (a compile, say) leaves the others' rows
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
            counters.zero_()
            continue
        err = ""
        if name.startswith("both"):
            want = exact_down(gu[0], dn[0])
            err = ((got[0].float() - want).abs().max() / want.abs().max()).item()
            if err > (2 ** -7 if dtype != torch.float32 else 1e-5) or counters.any():
                print(f"{name}: error {err:.3g} against float32 or counters left {counters.tolist()}; not timed",
                      flush=True)
                continue
        row = dict(vers, batch=rows, adapters=args.adapters, rank=args.rank, variant=name,
                   rel_err_vs_float32=f"{err:.2e}" if err != "" else "")
        if timer is not None:
            g = capture(fn)
            row["us_per_layer"] = round(timer(g.replay) / layers, 2)
            del g
            assert not counters.any(), counters
        rows_out.append(row)
        print(f"{name:75s} {row.get('us_per_layer', '-')} us a layer, error against float32 "
              f"{row['rel_err_vs_float32']}", flush=True)
    if args.smoke:
        print("smoke: every variant ran and matched float32 math")
    return bg.write_out(rows_out, args.out)


if __name__ == "__main__":
    sys.exit(main())
