"""Probe (#13, batch 128): a mixed batch's gate/up in one launch, the shrink computed by extra
programs of that launch while the gated tiles stream the weight.

``probe_glu_kext.py`` bounds the expand as reduction columns of the base model's gated tile at
66.7-68.4 us a layer against 78.35 for the library's fold + expand + act-mul, leaving about 10 us for
the shrink; as a launch of its own the shrink costs 7-9. Here the launch's first ``NS`` programs
compute it (``x @ A.T`` over every slot's A rows, gate's then up's, masked to each row's slot and
scaled) and count themselves done on a flag; the other programs are the gated tiles, which read the
shrink only after their K loop, waiting on the flag there (the shrink programs have the lowest ids,
so the hardware dispatches them first: a tile never waits on a program that cannot run). The last
tile resets the flag for the next launch. Timed as ``probe_glu_tail.py`` timed (32 layers of
distinct weights in one CUDA graph, each after an RMSNorm, L2 flushed), against the library's
launches and the base model's tile, and checked against the library's output.

    python benchmarks/probe_glu_hidden_shrink.py --out benchmarks/results/probe_glu_hidden_shrink_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import bench_generate as bg  # noqa: E402

from peft_fastlora.kernel_support import interpreting  # noqa: E402
from peft_fastlora.ops import pdl  # noqa: E402
from peft_fastlora.ops.glu_lora import gated_k_loop  # noqa: E402
from peft_fastlora.ops.silu_mul import act_mul_rounded  # noqa: E402
from peft_fastlora.ops.stream_gemm import _tile_dot  # noqa: E402


# ops.glu_lora with B's columns, by its arguments: the shrink programs' size, and the "timing only"
# ones, which leave out part of the work (``skip``: their results are wrong) to split the launch's time
# over the base tile. Session 33's other forms (the tail in one loop, an L2 prefetch of B's columns,
# early or release-only tickets, polls by acquire loads, the shrink programs at the highest ids) were
# measured at commit 1958eb3 (probe_glu_tail_s33*_h200.csv) and removed: none was faster.
TAIL_VARIANTS = {
    "16-row shrink programs (session 32)": {},
    "32-row shrink programs": dict(shrink_columns=32),
    "64-row shrink programs": dict(shrink_columns=64),
    "timing only: no tail (the wait kept)": dict(skip=1),
    "timing only: no wait, no tail (the shrink programs kept)": dict(skip=2),
    "timing only: nor any shrink work (its programs idle)": dict(skip=3),
    "timing only: nor any counter touched": dict(skip=4),
    "timing only: the bare tiles (no shrink programs)": dict(skip=5),
}


@triton.jit
def _glu_hidden_shrink_kernel(x_desc, w_desc, a_desc, bt_desc, s_ptr, y_ptr, row_slot_ptr, col_slot_ptr,
                              col_scale_ptr, flag_ptr, ticket_ptr, M, N, K, T, stride_s, stride_y,
                              ad_desc, ds_ptr, dslot_ptr, RD,
                              NS: tl.constexpr, SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr,
                              USE_PDL: tl.constexpr, DOWN: tl.constexpr, BLOCK_R: tl.constexpr):
    pdl.launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    pdl.wait(USE_PDL)
    if pid < NS:
        # shrink columns [c0, c0 + SB) of s (2T wide: gate's T, then up's)
        c0 = pid * SB
        s_acc = tl.zeros((BLOCK_M, SB), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            s_acc = _tile_dot(x_desc.load([0, k]), a_desc.load([c0, k]), s_acc, UPCAST)
        offs_c = c0 + tl.arange(0, SB)
        c_ok = offs_c < 2 * T
        col = offs_c % T
        cs = tl.load(col_slot_ptr + col, mask=c_ok, other=-2)
        sc = tl.load(col_scale_ptr + col, mask=c_ok, other=0.0)
        rs = tl.load(row_slot_ptr + offs_m, mask=m_ok, other=-1)
        keep = (rs[:, None] == cs[None, :]) & (rs[:, None] >= 0)
        s = tl.where(keep, s_acc * sc[None, :], 0.0)
        tl.store(s_ptr + offs_m[:, None] * stride_s + offs_c[None, :], s.to(s_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & c_ok[None, :])
        if DOWN:  # down's shrink sum back to zero before any tile adds to it (the count orders them)
            for c in range(pid * BLOCK_R, RD, NS * BLOCK_R):
                cols = c + tl.arange(0, BLOCK_R)
                tl.store(ds_ptr + offs_m[:, None] * RD + cols[None, :], tl.zeros((BLOCK_M, BLOCK_R), tl.float32),
                         mask=m_ok[:, None] & (cols < RD)[None, :])
        tl.atomic_add(flag_ptr, 1, sem="release")
    else:
        n0 = (pid - NS) * BLOCK_N
        acc, acc_up = gated_k_loop(x_desc, w_desc, n0, N, K, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, UPCAST)
        done = tl.atomic_add(flag_ptr, 0, sem="acquire")
        while done < NS:  # the shrink programs (lower ids: already running or done)
            done = tl.atomic_add(flag_ptr, 0, sem="acquire")
        for t in range(0, T, BLOCK_K):
            offs_t = t + tl.arange(0, BLOCK_K)
            t_ok = offs_t < T
            sg = tl.load(s_ptr + offs_m[:, None] * stride_s + offs_t[None, :], mask=m_ok[:, None] & t_ok[None, :],
                         other=0.0, cache_modifier=".cg")
            su = tl.load(s_ptr + offs_m[:, None] * stride_s + T + offs_t[None, :],
                         mask=m_ok[:, None] & t_ok[None, :], other=0.0, cache_modifier=".cg")
            acc = _tile_dot(sg, bt_desc.load([n0, t]), acc, UPCAST)
            acc_up = _tile_dot(su, bt_desc.load([N + n0, t]), acc_up, UPCAST)
        dt = y_ptr.dtype.element_ty
        offs_n = n0 + tl.arange(0, BLOCK_N)
        out = act_mul_rounded(acc.to(dt).to(tl.float32), acc_up.to(dt).to(tl.float32), dt, False, False)
        tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], out.to(dt),
                 mask=m_ok[:, None] & (offs_n < N)[None, :])
        if DOWN:
            # down_proj's shrink, this tile's part: its BLOCK_N columns of the act-mul output (down's
            # K) against the same columns of down's A arena (RD rows), summed over the tiles in float32
            # (DOWN == 2: only the sums a row's expand reads, its own slot's columns, are added)
            h = out.to(dt)
            rs = tl.load(row_slot_ptr + offs_m, mask=m_ok, other=-1)
            for r0 in range(0, RD, BLOCK_R):
                rr = r0 + tl.arange(0, BLOCK_R)
                part = _tile_dot(h, ad_desc.load([r0, n0]), tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32), UPCAST)
                add = m_ok[:, None] & (rr < RD)[None, :]
                if DOWN >= 2:
                    ds_slot = tl.load(dslot_ptr + rr, mask=rr < RD, other=-2)
                    add = add & (rs[:, None] == ds_slot[None, :])
                tl.atomic_add(ds_ptr + offs_m[:, None] * RD + rr[None, :], part, mask=add, sem="relaxed")
        if DOWN == 3:
            tl.debug_barrier()  # (all the block's partials before its ticket's release)
        # the last tile puts the flag back for the next launch (every tile has read it by then)
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == tl.num_programs(0) - NS - 1:
            if DOWN == 3:
                # every tile's partials are in (their tickets released them): the sum, scaled and
                # rounded, goes to the output's columns [N, N + RD), where a down_proj folded along
                # K ([W | B]) reads it as more of its input
                for r0 in range(0, RD, BLOCK_R):
                    rr = r0 + tl.arange(0, BLOCK_R)
                    r_ok = rr < RD
                    v = tl.load(ds_ptr + offs_m[:, None] * RD + rr[None, :], mask=m_ok[:, None] & r_ok[None, :],
                                other=0.0, cache_modifier=".cg")
                    v = v * tl.load(col_scale_ptr + rr, mask=r_ok, other=0.0)[None, :]
                    tl.store(y_ptr + offs_m[:, None] * stride_y + N + rr[None, :], v.to(dt),
                             mask=m_ok[:, None] & r_ok[None, :])
            tl.atomic_xchg(flag_ptr, 0)
            tl.atomic_xchg(ticket_ptr, 0)


def glu_hidden_shrink(x, w, a2, bt, s, out, row_slot, col_slot, col_scale, counters, cfg, sb=16, down=None):
    """``act(x @ gate.T + dg) * (x @ up.T + du)`` with the shrink in the same launch (module doc).
    x (M <= 128, K); w (2N, K) [gate; up]; a2 (2T, K) every slot's gate A rows then up's; bt (2N, T)
    their B columns; s (M, 2T) scratch; counters (2,) int32 zeros (flag, ticket), zero again after.
    ``down``: (A_down (RD, N), ds (M, RD) float32): the launch also writes down_proj's shrink of its
    output, ``out @ A_down.T``, to ``ds`` (``probe_down_shrink_in_glu.py``); (A_down, ds, slot of each
    of A_down's rows): only each row's own slot's sums, the rest left zero; (A_down, ds, slots, True):
    also the sum scaled by ``col_scale`` and rounded into ``out``'s next RD columns (``out`` a view of
    a wider buffer), for a down_proj folded along K."""
    m, k = x.shape
    n, t = w.shape[0] // 2, bt.shape[1]
    block_m = max(16, triton.next_power_of_2(m))
    bn, bk, stages, warps = cfg
    ns = triton.cdiv(2 * t, sb)
    use_pdl = pdl.mode(x)
    block_r = 64
    ad, ds, ds_slot, k_fold = (tuple(down) + (None, False))[:4] if down is not None else (w, s, None, False)
    _glu_hidden_shrink_kernel[(ns + triton.cdiv(n, bn),)](
        TensorDescriptor.from_tensor(x, [block_m, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(a2, [sb, bk]), TensorDescriptor.from_tensor(bt, [bn, bk]),
        s, out, row_slot, col_slot, col_scale, counters, counters[1:], m, n, k, t, s.stride(0), out.stride(0),
        TensorDescriptor.from_tensor(ad, [block_r, bn]), ds, col_slot if ds_slot is None else ds_slot,
        ad.shape[0] if down is not None else 0,
        NS=ns, SB=sb, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages,
        UPCAST=x.dtype == torch.float32 or interpreting(), USE_PDL=use_pdl,
        DOWN=0 if down is None else 1 if ds_slot is None else 3 if k_fold else 2, BLOCK_R=block_r,
        num_warps=warps, launch_pdl=use_pdl > 0)
    return out


def layer_operands(k, n, ranks, rows, device, dtype, gen):
    """One layer's gate/up: the folded weight ``[gate; up; A]`` as the library packs it (A rows
    ``a_rows``, B flat at ``b_offs``), and the same adapters as this kernel takes them: A (gate's rows
    of every slot, then up's) and B ((2n, T)). Returns a dict of both."""
    from bench_kernels import packed_layout

    c = 2  # gate, up
    _, b_offs, t_rows, b_len = packed_layout((0, n, 2 * n), ranks)
    # A as ``lora.pool`` lays a site out: a region per module (gate's blocks, then up's)
    starts = [sum(ranks[:s]) for s in range(len(ranks))]
    a_rows = torch.tensor([[st, sum(ranks) + st] for st in starts], dtype=torch.int32)
    ext = torch.empty(2 * n + t_rows, k, device=device, dtype=dtype)
    ext[: 2 * n].normal_(generator=gen).mul_(k ** -0.5)
    b_flat = torch.zeros(b_len + 64, device=device, dtype=dtype)[:b_len]  # (ops.glu_lora reads past its end)
    t = sum(ranks)
    a_tail = torch.empty(2 * t, k, device=device, dtype=dtype)
    b_tail = torch.zeros(2 * n, t, device=device, dtype=dtype)
    col = 0
    for s, r in enumerate(ranks):
        for j in range(c):
            a = torch.randn(r, k, generator=gen, device=device, dtype=dtype) * k ** -0.5
            b = torch.randn(n, r, generator=gen, device=device, dtype=dtype) * r ** -0.5
            ext[2 * n + a_rows[s, j]: 2 * n + a_rows[s, j] + r] = a
            b_flat[b_offs[s, j]: b_offs[s, j] + n * r] = b.flatten()
            a_tail[j * t + col: j * t + col + r] = a
            b_tail[j * n:(j + 1) * n, col:col + r] = b
        col += r
    return dict(ext=ext, w=ext[: 2 * n], b_flat=b_flat, a_rows=a_rows.to(device), b_offs=b_offs.to(device),
                a_tail=a_tail, b_tail=b_tail, y=torch.empty(rows, 2 * n + t_rows, device=device, dtype=dtype),
                s=torch.empty(rows, 2 * t + 64, device=device, dtype=dtype),
                h=torch.empty(rows, n, device=device, dtype=dtype))


def probe_arguments(p: argparse.ArgumentParser, out: str) -> None:
    """The arguments the gate/up probes share."""
    p.add_argument("--out", default=out)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, no timing")


def probe_setup(args, name: str):
    """The shapes, timer and tiles of a gate/up probe: the 8B shapes on the GPU, tiny ones on the CPU
    (``--smoke``); None where there is no GPU. Returns a namespace of device, dtype, k, n, layers,
    rows, timer, vers, cfg (the prototype's tile), base_cfg (the library's gated tile)."""
    from types import SimpleNamespace

    from bench_kernels import gpu_probe
    from peft_fastlora.base_ops.stream_linears import tma_tiles
    from peft_fastlora.ops.tma_gemm import TmaConfig

    if args.smoke:
        return SimpleNamespace(device="cpu", dtype=torch.float32, k=64, n=48, layers=2, rows=5, timer=None,
                               vers={"gpu": "cpu (smoke)"}, cfg=(16, 16, 2, 4), base_cfg=TmaConfig(16, 16, 1, 4, 2))
    probe = gpu_probe(name, args.iters)
    if probe is None:
        return None
    timer, _, vers = probe
    base_cfg = tma_tiles()["glu"].config  # the base model's gated tile
    return SimpleNamespace(device="cuda", dtype=torch.bfloat16, k=4096, n=14336, layers=args.layers, rows=args.batch,
                           timer=timer, vers=vers, base_cfg=base_cfg,
                           cfg=(base_cfg.block_n, base_cfg.block_k, base_cfg.num_stages, base_cfg.num_warps))


def mixed_batch(args, rows: int, device):
    """The probes' batch: rows taking the adapters in turn and every (adapters + 1)-th row none,
    scalings 0.5-1.25. Returns a namespace of ranks, scalings, bi (the backend's batch), plan (its
    expand plan), col_slot and col_scale (each arena column's slot and scaling, one module), row_slot,
    counters (zeros)."""
    from types import SimpleNamespace

    from peft_fastlora import ForwardBatch, get_backend

    ranks = [args.rank] * args.adapters
    slots = [i % (args.adapters + 1) for i in range(rows)]
    slots = [-1 if sl == args.adapters else sl for sl in slots]  # -1: a row of no adapter
    scalings = [0.5 + 0.25 * (s % 4) for s in range(args.adapters)]
    backend = get_backend("triton")(args.adapters, device)
    bi = backend.prepare_lora_batch(ForwardBatch.from_shape(rows, 1, device), slots, ranks, scalings,
                                    use_cuda_graph=False)
    return SimpleNamespace(
        ranks=ranks, scalings=scalings, bi=bi, plan=(bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len),
        col_slot=torch.tensor([s for s, r in enumerate(ranks) for _ in range(r)], dtype=torch.int32, device=device),
        col_scale=torch.tensor([scalings[s] for s, r in enumerate(ranks) for _ in range(r)], device=device),
        row_slot=torch.tensor(slots, dtype=torch.int32, device=device),
        counters=torch.zeros(2, dtype=torch.int32, device=device))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    probe_arguments(p, "benchmarks/results/probe_glu_hidden_shrink_h200.csv")
    p.add_argument("--shrink-blocks", type=int, nargs="+", default=[16, 32], help="shrink columns a program")
    p.add_argument("--only", nargs="+", default=None, help="run the variants whose names hold one of these")
    args = p.parse_args(argv)
    from bench_kernels import capture
    from peft_fastlora.ops.lora_expand import lora_expand
    from peft_fastlora.ops.rms_norm import rms_norm
    from peft_fastlora.ops.silu_mul import act_mul
    from peft_fastlora.ops.tma_gemm import tma_gemm

    setup = probe_setup(args, "probe_glu_hidden_shrink")
    if setup is None:
        return 0
    device, dtype, k, n, layers, rows = setup.device, setup.dtype, setup.k, setup.n, setup.layers, setup.rows
    timer, vers, cfg, base_cfg = setup.timer, setup.vers, setup.cfg, setup.base_cfg
    mb = mixed_batch(args, rows, device)
    ranks, scalings, bi, plan = mb.ranks, mb.scalings, mb.bi, mb.plan
    col_slot, col_scale, row_slot, counters = mb.col_slot, mb.col_scale, mb.row_slot, mb.counters
    gen = torch.Generator(device=device).manual_seed(0)
    ops = [layer_operands(k, n, ranks, rows, device, dtype, gen) for _ in range(layers)]
    x = torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
    norm_w = torch.ones(k, device=device, dtype=dtype)
    rt = torch.tensor([[r, r] for r in ranks], dtype=torch.int32, device=device)
    sc = torch.tensor([[v, v] for v in scalings], dtype=torch.float32, device=device)

    def library(o, xn):  # what the mixed step runs today at 65-128 rows
        torch.matmul(xn, o["ext"].T, out=o["y"])
        lora_expand(o["y"][:, 2 * n:], o["b_flat"], (0, n, 2 * n), rt, sc, o["y"][:, : 2 * n], *plan,
                    block_m=bi.block_m, check=False, b_offs=o["b_offs"], b_align=8 if args.rank % 8 == 0 else 1,
                    y_cols=o["a_rows"], max_rank=args.rank)
        return act_mul(o["y"][:, :n], o["y"][:, n: 2 * n], "silu")

    from peft_fastlora.ops.glu_lora import GluLora, glu_lora

    t_all = sum(ranks)

    t0_pad = -(-t_all // 64) * 64

    def b_columns(o):  # GluLora.bt: B's columns as the arena's rows, gate's then (from t0_pad) up's
        if "bt" not in o:
            o["bt"] = torch.zeros(n, t0_pad + t_all, device=device, dtype=dtype)
            o["bt"][:, :t_all] = o["b_tail"][:n]
            o["bt"][:, t0_pad:] = o["b_tail"][n:]
        return o["bt"]

    def library_one_launch(o, xn, align=8 if args.rank % 8 == 0 else 1, bt=False, variant=None):
        # ops.glu_lora: B read from the packed arena (align 1: 2-byte loads), or from its columns (bt)
        lora = GluLora(row_slot, col_slot.repeat(2), t_all, o["b_flat"], rt, sc, o["a_rows"], o["b_offs"],
                       o["s"], counters, args.rank, align, b_columns(o) if bt else None, t0_pad if bt else 0)
        return glu_lora(xn, o["ext"], n, lora, "silu", base_cfg, out=o["h"], check=False, **(variant or {}))

    variants = {
        "library: folded cuBLAS + expand + act-mul": library,
        "library: ops.glu_lora (one launch, B from the packed arena, 4 slots a K block)": library_one_launch,
        "library: ops.glu_lora, B's columns through a descriptor (bt)":
            lambda o, xn: library_one_launch(o, xn, bt=True),
        "library: ops.glu_lora, B's loads not vectorized (align 1)": lambda o, xn: library_one_launch(o, xn, 1),
        **{f"library: ops.glu_lora, bt, {name}": (lambda o, xn, v=v: library_one_launch(o, xn, bt=True, variant=v))
           for name, v in TAIL_VARIANTS.items()},
        "base only: the gated tile, no LoRA": lambda o, xn: tma_gemm(xn, o["w"], out=o["h"], config=base_cfg,
                                                                     glu="silu", check=False),
    }
    for sb in args.shrink_blocks:
        variants[f"one launch: shrink in {sb}-column programs + gated tiles"] = (
            lambda o, xn, sb=sb: glu_hidden_shrink(xn, o["w"], o["a_tail"], o["b_tail"], o["s"], o["h"], row_slot,
                                                   col_slot, col_scale, counters, cfg, sb=sb))

    def run(fn):
        return [fn(o, rms_norm(x, norm_w, 1e-5)) for o in ops]

    # the first layer in float32 from the same bf16 operands: each variant's error against it, and the
    # library's (its launches round the base output, the shrink and the delta apart)
    o, xn = ops[0], rms_norm(x, norm_w, 1e-5).float()
    keep = (row_slot[:, None] == col_slot.repeat(2)[None, :]) & (row_slot[:, None] >= 0)
    s32 = (xn @ o["a_tail"].float().T) * torch.where(keep, col_scale.repeat(2)[None, :], 0.0)
    t = len(col_slot)
    both = xn @ o["w"].float().T + torch.cat([s32[:, :t] @ o["b_tail"][:n].float().T,
                                              s32[:, t:] @ o["b_tail"][n:].float().T], dim=1)
    exact = torch.nn.functional.silu(both[:, :n]) * both[:, n:]

    def error(h):
        return ((h.float() - exact).abs().max() / exact.abs().max()).item()

    library_err = error(run(library)[0])
    rows_out = []
    if args.only:
        variants = {name: fn for name, fn in variants.items() if any(o in name for o in args.only)}
    for name, fn in variants.items():
        got = run(fn)[0].clone()
        err = ""
        if "base only" not in name and "timing only" not in name:
            err = error(got)
            if err > max(2 * library_err, 2 ** -7 if dtype != torch.float32 else 1e-5) or counters.any():
                print(f"{name}: error {err:.3g} against float32 (the library's {library_err:.3g}) or counters left "
                      f"{counters.tolist()}; not timed", flush=True)
                continue
        row = dict(vers, batch=rows, adapters=args.adapters, rank=args.rank, variant=name,
                   rel_err_vs_float32=f"{err:.2e}" if err != "" else "")
        if timer is not None:
            g = capture(lambda fn=fn: run(fn))
            row["us_per_layer"] = round(timer(g.replay) / layers, 2)
            del g
            assert not counters.any(), counters  # every replay put them back
        rows_out.append(row)
        print(f"{name:60s} {row.get('us_per_layer', '-')} us a layer, error against float32 "
              f"{row['rel_err_vs_float32']}", flush=True)
    if args.smoke:
        print("smoke: every variant ran and matched the library's launches")
    return bg.write_out(rows_out, args.out)


if __name__ == "__main__":
    sys.exit(main())
