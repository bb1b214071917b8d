"""Probe (#13): the q/k/v LoRA expand inside the rotary + KV-write launch, against the library's two
launches (``ops.lora_expand`` into the folded q/k/v GEMM's output, then ``ops.rotary_kv``).

A mixed step's folded q/k/v site runs cuBLAS over ``[W; A]`` (base columns and every slot's shrink
columns), then the expand (a launch after cuBLAS, which does not let it start early), then the
rotary + KV-write kernel. Here a probe kernel of its own (one program per token and head) adds each
token's delta, ``scale * B @ s`` over its slot's shrink columns, to the head's base columns before it
rotates q and k and writes k and v to the cache: the expand's launch is gone; the plan and B are read
before the PDL wait, the GEMM's output after it. Each layer is an RMSNorm, the folded q/k/v GEMM
(cuBLAS) and the variant; 32 layers of distinct weights in one CUDA graph, us a layer, the 8B shape,
batches 1 / 32 / 128, 8 adapters of rank 16. Outputs (q, and the cache at the written position)
checked against the library's launches (bf16 roundings apart).

    python benchmarks/probe_rotary_lora.py --out benchmarks/results/probe_rotary_lora_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import bench_generate as bg  # noqa: E402

from peft_fastlora.ops import pdl  # noqa: E402
from peft_fastlora.ops.rotary import cos_sin_halves, rotate_halves  # noqa: E402


@triton.jit
def _head_b(b_ptr, tok_slot, a_rows_ptr, b_offs_ptr, ranks_ptr, scal_ptr, j, head_col, half, offs_d, d_ok, offs_r,
            use):
    """What one head's LoRA delta needs before the GEMM's output is ready (read before the PDL wait:
    the plan and B are written before the step): the head's columns of module ``j``'s packed
    ``(width, rank)`` B block of the token's slot, as two (BLOCK_D, BLOCK_R) halves, the slot's first
    shrink column, its scaling and which of the BLOCK_R columns are within its rank (none for a token
    of no adapter, or where ``use`` is false)."""
    has = (tok_slot >= 0) & use
    sl = tl.maximum(tok_slot, 0)
    r = tl.where(has, tl.load(ranks_ptr + sl * 3 + j), 0)
    a0 = tl.load(a_rows_ptr + sl * 3 + j)
    bo = tl.load(b_offs_ptr + sl * 3 + j)
    sc = tl.load(scal_ptr + sl * 3 + j)
    r_ok = offs_r < r
    m = d_ok[:, None] & r_ok[None, :]
    b_head = b_ptr + bo + head_col.to(tl.int64) * r
    b1 = tl.load(b_head + offs_d[:, None] * r + offs_r[None, :], mask=m, other=0.0)
    b2 = tl.load(b_head + (offs_d[:, None] + half) * r + offs_r[None, :], mask=m, other=0.0)
    return b1, b2, a0, sc, r_ok


@triton.jit
def _head_delta(y_row, s_col0, b1, b2, a0, sc, r_ok, offs_r):
    """``scale * B @ s`` of one head (two fp32 halves), s the slot's shrink columns of the GEMM's
    output row (read after the wait)."""
    s = tl.load(y_row + s_col0 + a0 + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    return (tl.sum(b1.to(tl.float32) * s[None, :], axis=1) * sc,
            tl.sum(b2.to(tl.float32) * s[None, :], axis=1) * sc)


@triton.jit
def _rotary_kv_lora_kernel(y_ptr, stride_y, s_col0, b_ptr, tok_slot_ptr, a_rows_ptr, b_offs_ptr, ranks_ptr, scal_ptr,
                           cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, length_ptr,
                           NQ, half, kc_sb, kc_sh, kc_ss,
                           BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, LORA: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.launch_dependents(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_q = h < NQ
    kh = tl.where(is_q, 0, h - NQ)
    dim = 2 * half
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < half
    offs_r = tl.arange(0, BLOCK_R)
    y_row = y_ptr + tok * stride_y
    col = tl.where(is_q, h * dim, NQ * dim + kh * dim)  # the head's first column in y
    vcol = NQ * dim + (tl.num_programs(1) - NQ) * dim + kh * dim  # its value head's (key heads)
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr, sin_ptr, tok * dim, half, offs_d, d_ok)
    if LORA:  # module 0 (q) or 1 (k), and 2 (v) for a key head
        tok_slot = tl.load(tok_slot_ptr + tok)
        b1, b2, a0, sc, r_ok = _head_b(b_ptr, tok_slot, a_rows_ptr, b_offs_ptr, ranks_ptr, scal_ptr,
                                       tl.where(is_q, 0, 1), tl.where(is_q, h, kh) * dim, half, offs_d, d_ok, offs_r,
                                       True)
        vb1, vb2, va0, vsc, vr_ok = _head_b(b_ptr, tok_slot, a_rows_ptr, b_offs_ptr, ranks_ptr, scal_ptr, 2,
                                            kh * dim, half, offs_d, d_ok, offs_r, not is_q)
    pdl.wait(USE_PDL)
    x1 = tl.load(y_row + col + offs_d, mask=d_ok, other=0.0)
    x2 = tl.load(y_row + col + half + offs_d, mask=d_ok, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if LORA:
        d1, d2 = _head_delta(y_row, s_col0, b1, b2, a0, sc, r_ok, offs_r)
        x1 = (x1 + d1).to(dt).to(tl.float32)  # rounded as the expand stores it
        x2 = (x2 + d2).to(dt).to(tl.float32)
    y1, y2 = rotate_halves(x1[None, :], x2[None, :], c1, c2, s1, s2, dt)
    pos = tl.load(length_ptr).to(tl.int64)
    cache_at = tok * kc_sb + kh.to(tl.int64) * kc_sh + pos * kc_ss
    dst = tl.where(is_q, q_out_ptr + (tok * NQ + h) * dim, k_cache_ptr + cache_at)
    tl.store(dst + offs_d[None, :], y1, mask=d_ok[None, :])
    tl.store(dst + half + offs_d[None, :], y2, mask=d_ok[None, :])
    if not is_q:  # the key head's value head
        v1 = tl.load(y_row + vcol + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        v2 = tl.load(y_row + vcol + half + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        if LORA:
            e1, e2 = _head_delta(y_row, s_col0, vb1, vb2, va0, vsc, vr_ok, offs_r)
            v1 = v1 + e1
            v2 = v2 + e2
        tl.store(v_cache_ptr + cache_at + offs_d, v1.to(dt), mask=d_ok)
        tl.store(v_cache_ptr + cache_at + half + offs_d, v2.to(dt), mask=d_ok)


def fused(y, s_col0, b_flat, tok_slot, a_rows, b_offs, ranks, scal, cos, sin, q_out, k_cache, v_cache, length,
          nq, nkv, head_dim, max_rank, lora):
    use_pdl = pdl.mode(y)
    _rotary_kv_lora_kernel[(y.shape[0], nq + nkv)](
        y, y.stride(0), s_col0, b_flat, tok_slot, a_rows, b_offs, ranks, scal, cos, sin, q_out, k_cache, v_cache,
        length, nq, head_dim // 2, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_D=triton.next_power_of_2(head_dim // 2), BLOCK_R=max(16, triton.next_power_of_2(max_rank)), LORA=lora,
        USE_PDL=use_pdl, num_warps=2, enable_fp_fusion=False, launch_pdl=use_pdl > 0)
    return q_out


@triton.jit
def _rotary_kv_chunks_kernel(y_ptr, stride_y, s_col0, b_ptr, tok_slot_ptr, sorted_ptr, chunk_slot_ptr, chunk_start_ptr,
                             chunk_len_ptr, a_rows_ptr, b_offs_ptr, ranks_ptr, scal_ptr, cos_ptr, sin_ptr, q_out_ptr,
                             k_cache_ptr, v_cache_ptr, length_ptr, M, NQ, NKV, half, max_len, kc_sb, kc_sh, kc_ss,
                             MAX_CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, HB: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_R: tl.constexpr, LORA: tl.constexpr, USE_PDL: tl.constexpr):
    """Session 37's form: a program takes ``HB`` heads of one module (q, k or v) for the rows of one
    plan chunk (rows of one slot, ``BLOCK_M`` at most: B's tile read once, the delta a tensor-core
    dot) or, past the chunks, a tile of ``BLOCK_M`` rows of no adapter (rotary only). The plan,
    B's tile, the slot's rank, scaling and shrink column are read before the PDL wait."""
    pdl.launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    h0 = tl.program_id(1) * HB  # the block's first head: q heads, then k's, then v's
    j = tl.where(h0 < NQ, 0, tl.where(h0 < NQ + NKV, 1, 2))
    mod_h0 = tl.where(j == 0, 0, tl.where(j == 1, NQ, NQ + NKV))
    dim = 2 * half
    offs_i = tl.arange(0, HB * BLOCK_D)
    h_loc = offs_i // BLOCK_D
    d = offs_i % BLOCK_D
    i_ok = d < half
    col1 = (h0 + h_loc) * dim + d  # the first half's columns in y; the second's are half past
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    is_chunk = pid < MAX_CHUNKS
    # a chunk: its rows and slot; past the chunks: a tile of rows, those of no adapter kept
    c = tl.minimum(pid, MAX_CHUNKS - 1)
    slot = tl.where(is_chunk, tl.load(chunk_slot_ptr + c), -1)
    tile_rows = (pid - MAX_CHUNKS) * BLOCK_M + offs_m
    tile_ok = (tile_rows >= 0) & (tile_rows < M)  # (a chunk's program: all below 0)
    tile_ok = tile_ok & (tl.load(tok_slot_ptr + tile_rows, mask=tile_ok, other=0) < 0)
    chunk_ok = offs_m < tl.where(is_chunk, tl.load(chunk_len_ptr + c), 0)
    chunk_rows = tl.load(sorted_ptr + tl.load(chunk_start_ptr + c) + offs_m, mask=chunk_ok, other=0)
    m_ok = chunk_ok | tile_ok
    rows = tl.where(is_chunk, chunk_rows, tile_rows)
    sl = tl.maximum(slot, 0)
    r = tl.where(LORA & (slot >= 0), tl.load(ranks_ptr + sl * 3 + j), 0)
    a0 = tl.load(a_rows_ptr + sl * 3 + j)
    sc = tl.load(scal_ptr + sl * 3 + j)
    b_rows = (h0 - mod_h0 + h_loc) * dim + d
    bm = i_ok[:, None] & (offs_r < r)[None, :]
    b_at = b_ptr + tl.load(b_offs_ptr + sl * 3 + j) + b_rows[:, None].to(tl.int64) * r + offs_r[None, :]
    b1 = tl.load(b_at, mask=bm, other=0.0)
    b2 = tl.load(b_at + half * r, mask=bm, other=0.0)
    pdl.wait(USE_PDL)
    rows64 = rows.to(tl.int64)
    y_at = y_ptr + rows64[:, None] * stride_y + col1[None, :]
    mask = m_ok[:, None] & i_ok[None, :]
    x1 = tl.load(y_at, mask=mask, other=0.0)
    x2 = tl.load(y_at + half, mask=mask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if r > 0:  # a chunk of an adapter's rows: its delta, rounded as the expand stores it
        s = tl.load(y_ptr + rows64[:, None] * stride_y + s_col0 + a0 + offs_r[None, :],
                    mask=m_ok[:, None] & (offs_r < r)[None, :], other=0.0)
        x1 = (x1 + tl.dot(s, tl.trans(b1)) * sc).to(dt).to(tl.float32)
        x2 = (x2 + tl.dot(s, tl.trans(b2)) * sc).to(dt).to(tl.float32)
    pos = tl.load(length_ptr).to(tl.int64)
    kh = (h0 - mod_h0 + h_loc).to(tl.int64)
    cache_at = rows64[:, None] * kc_sb + kh[None, :] * kc_sh + pos * kc_ss + d[None, :]
    keep = mask & ((tl.zeros([BLOCK_M], dtype=tl.int64) + pos) < max_len)[:, None]
    if j == 2:
        tl.store(v_cache_ptr + cache_at, x1.to(dt), mask=keep)
        tl.store(v_cache_ptr + cache_at + half, x2.to(dt), mask=keep)
    else:
        c_at = rows64[:, None] * dim + d[None, :]
        c1 = tl.load(cos_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_at + half, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_at + half, mask=mask, other=0.0).to(tl.float32)
        y1, y2 = rotate_halves(x1, x2, c1, c2, s1, s2, dt)
        if j == 0:
            q_at = q_out_ptr + (rows64[:, None] * NQ + (h0 + h_loc)[None, :]) * dim + d[None, :]
            tl.store(q_at, y1, mask=mask)
            tl.store(q_at + half, y2, mask=mask)
        else:
            tl.store(k_cache_ptr + cache_at, y1, mask=keep)
            tl.store(k_cache_ptr + cache_at + half, y2, mask=keep)


def chunked(y, s_col0, b_flat, tok_slot, plan, a_rows, b_offs, ranks, scal, cos, sin, q_out, k_cache, v_cache, length,
            nq, nkv, head_dim, max_rank, lora, heads=4):
    use_pdl = pdl.mode(y)
    sorted_ids, chunk_slot, chunk_start, chunk_len = plan
    max_chunks, block_m = chunk_slot.shape[0], 16
    heads = min(heads, nkv)
    _rotary_kv_chunks_kernel[(max_chunks + triton.cdiv(y.shape[0], block_m), (nq + 2 * nkv) // heads)](
        y, y.stride(0), s_col0, b_flat, tok_slot, sorted_ids, chunk_slot, chunk_start, chunk_len, a_rows, b_offs,
        ranks, scal, cos, sin, q_out, k_cache, v_cache, length, y.shape[0], nq, nkv, head_dim // 2, k_cache.shape[2],
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        MAX_CHUNKS=max_chunks, BLOCK_M=block_m, HB=heads, BLOCK_D=triton.next_power_of_2(head_dim // 2),
        BLOCK_R=max(16, triton.next_power_of_2(max_rank)), LORA=lora, USE_PDL=use_pdl, num_warps=4,
        enable_fp_fusion=False, launch_pdl=use_pdl > 0)
    return q_out


def attention_setup(args, name: str, smoke_batches):
    """The shapes of an attention-site probe: the 8B's on the GPU (``args.layers``, ``args.batches``),
    tiny ones on the CPU (``args.smoke``); None where there is no GPU. Returns (device, dtype, hidden,
    q heads, kv heads, head dim, layers, timer, versions, batches)."""
    from bench_kernels import gpu_probe

    if args.smoke:
        return "cpu", torch.float32, 64, 4, 2, 16, 2, None, {"gpu": "cpu (smoke)"}, smoke_batches
    probe = gpu_probe(name, args.iters)
    if probe is None:
        return None
    timer, _, vers = probe
    return "cuda", torch.bfloat16, 4096, 32, 8, 128, args.layers, timer, vers, args.batches


def rotary_inputs(rows: int, nkv: int, d: int, dtype, device, gen):
    """A decode step's rotary and cache operands: random angles' cos and sin (rows, 1, d), zeroed K
    and V caches of 64 positions, the fill length at 5."""
    ang = torch.rand(rows, 1, d // 2, generator=gen, device=device) * 6.28
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    k_cache = torch.zeros(rows, nkv, 64, d, device=device, dtype=dtype)
    return cos, sin, k_cache, torch.zeros_like(k_cache), torch.tensor([5], dtype=torch.int32, device=device)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_rotary_lora_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, no timing")
    p.add_argument("--only", nargs="+", default=None,
                   help="the library's launches and the variants whose names hold one of these")
    args = p.parse_args(argv)
    from bench_kernels import capture, packed_layout
    from peft_fastlora import ForwardBatch, get_backend
    from peft_fastlora.ops.lora_expand import lora_expand
    from peft_fastlora.ops.rms_norm import rms_norm
    from peft_fastlora.ops.rotary_kv import rotary_kv_write

    setup = attention_setup(args, "probe_rotary_lora", [3, 20])
    if setup is None:
        return 0
    device, dtype, k, nq, nkv, d, layers, timer, vers, batches = setup
    offsets = (0, nq * d, (nq + nkv) * d, (nq + 2 * nkv) * d)
    n = offsets[-1]
    ranks = [args.rank] * args.adapters
    a_rows, b_offs, t_rows, b_len = packed_layout(offsets, ranks)
    gen = torch.Generator(device=device).manual_seed(0)
    ws = [torch.randn(n + t_rows, k, generator=gen, device=device, dtype=dtype) * k ** -0.5 for _ in range(layers)]
    bs = [torch.randn(b_len, generator=gen, device=device, dtype=dtype) * args.rank ** -0.5 for _ in range(layers)]
    a_rows, b_offs = a_rows.to(device), b_offs.to(device)
    scalings = [0.5 + 0.25 * (s % 4) for s in range(args.adapters)]
    rt = torch.tensor([[r] * 3 for r in ranks], dtype=torch.int32, device=device)
    sc = torch.tensor([[v] * 3 for v in scalings], dtype=torch.float32, device=device)
    norm_w = torch.ones(k, device=device, dtype=dtype)
    rows_out = []
    for rows in batches:
        slots = [i % (args.adapters + 1) for i in range(rows)]
        slots = [-1 if sl == args.adapters else sl for sl in slots]  # -1: a row of no adapter
        tok_slot = torch.tensor(slots, dtype=torch.int32, device=device)
        backend = get_backend("triton")(args.adapters, device)
        bi = backend.prepare_lora_batch(ForwardBatch.from_shape(rows, 1, device), slots, ranks, scalings,
                                        use_cuda_graph=False)
        plan = (bi.sorted_token_ids, bi.chunk_slot, bi.chunk_start, bi.chunk_len)
        x = torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
        y = torch.empty(rows, n + t_rows, device=device, dtype=dtype)
        cos, sin, k_cache, v_cache, length = rotary_inputs(rows, nkv, d, dtype, device, gen)
        q_out = torch.empty(rows, nq, 1, d, device=device, dtype=dtype)

        def gemm(w):
            torch.matmul(rms_norm(x, norm_w, 1e-5), w.T, out=y)

        def library(w, b, lora=True):
            gemm(w)
            if lora:
                lora_expand(y[:, n:], b, offsets, rt, sc, y[:, :n], *plan, block_m=bi.block_m, check=False,
                            b_offs=b_offs, b_align=8 if args.rank % 8 == 0 else 1, y_cols=a_rows, max_rank=args.rank)
            q = y[:, : offsets[1]].view(rows, 1, nq, d).transpose(1, 2)
            kk = y[:, offsets[1]: offsets[2]].view(rows, 1, nkv, d).transpose(1, 2)
            v = y[:, offsets[2]: n].view(rows, 1, nkv, d).transpose(1, 2)
            return rotary_kv_write(q, kk, v, cos, sin, k_cache, v_cache, length)

        def probe_kernel(w, b, lora=True):
            gemm(w)
            return fused(y, n, b, tok_slot, a_rows, b_offs, rt, sc, cos, sin, q_out, k_cache, v_cache, length,
                         nq, nkv, d, args.rank, lora)

        def chunk_kernel(w, b, lora=True, heads=4):
            gemm(w)
            return chunked(y, n, b, tok_slot, plan, a_rows, b_offs, rt, sc, cos, sin, q_out, k_cache, v_cache,
                           length, nq, nkv, d, args.rank, lora, heads)

        variants = {"library: expand + rotary_kv": library,
                    "probe kernel: the expand inside": probe_kernel,
                    "chunk kernel: the expand inside, 4 heads a program": chunk_kernel,
                    "chunk kernel: the expand inside, 2 heads a program": lambda w, b: chunk_kernel(w, b, heads=2),
                    "chunk kernel: the expand inside, 8 heads a program": lambda w, b: chunk_kernel(w, b, heads=8),
                    "library rotary_kv, no LoRA": lambda w, b: library(w, b, lora=False),
                    "probe kernel, no LoRA": lambda w, b: probe_kernel(w, b, lora=False),
                    "chunk kernel, no LoRA": lambda w, b: chunk_kernel(w, b, lora=False)}
        if args.only:
            variants = {k: v for k, v in variants.items() if k == "library: expand + rotary_kv"
                        or any(o in k for o in args.only)}
        want = {}
        for name, fn in variants.items():
            q = fn(ws[0], bs[0]).clone()
            kc, vc = k_cache[:, :, 5].clone(), v_cache[:, :, 5].clone()
            if not want:
                want = dict(q=q, k=kc, v=vc)
            got = dict(q=q, k=kc, v=vc)
            # against the library's launches; without LoRA, how large the delta is (a check that it is there)
            err = max(((got[t].float() - want[t].float()).abs().max() / want[t].float().abs().max()).item()
                      for t in got)
            if "no LoRA" in name:
                if err < 2 ** -4:
                    print(f"batch {rows} {name}: the LoRA delta is too small to check (relative {err:.3g})")
                    return 1
            elif err > 2 ** -7:
                    print(f"batch {rows} {name}: differs from the library's launches (relative {err:.3g})", flush=True)
                    continue
            row = dict(vers, batch=rows, adapters=args.adapters, rank=args.rank, variant=name,
                       rel_diff_to_library=f"{err:.2e}")
            if timer is not None:
                g = capture(lambda fn=fn: [fn(w, b) for w, b in zip(ws, bs)])
                row["us_per_layer"] = round(timer(g.replay) / layers, 2)
                del g
            rows_out.append(row)
            print(f"batch {rows:4d} {name:34s} {row.get('us_per_layer', '-')} us a layer (norm + q/k/v GEMM + it)  "
                  f"relative difference to the library {row['rel_diff_to_library']}", flush=True)
    if args.smoke:
        print("smoke: every variant ran and matched the library's launches")
    return bg.write_out(rows_out, args.out)


if __name__ == "__main__":
    sys.exit(main())
