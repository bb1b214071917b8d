"""Probe (#13): rotary and the KV-cache write as one kernel, against the two kernels of a step today.

A decode step runs, per layer, the q/k/v GEMM, ``ops.rotary`` (q and k rotated into new tensors),
``ops.kv_cache_write`` (the rotated k and v copied into the static cache at its fill length, which
the last program advances) and the attention. The second of the two small kernels reads what the
first has just written. ``_rotary_kv_write_kernel`` here does both: each program rotates a block of
heads of one token, storing query heads to the attention's q and key heads (rotated) with the
matching value heads straight into the cache. Its roundings are ``ops.rotary``'s, so the cache
and q are bit-equal to the two kernels' (checked before timing).

Timed in CUDA graphs of 32 layers at Llama-3-8B's attention shapes, each layer the chain of a step:
q/k/v GEMM (fastlora's streaming GEMM up to 64 rows, cuBLAS past), then the two kernels or the one,
then the decode attention over the cache. Reported: microseconds per layer of each chain.

    python benchmarks/probe_rotary_kv.py --out benchmarks/results/probe_rotary_kv_h200.csv
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_generate as bg  # noqa: E402
from peft_fastlora.ops import pdl  # noqa: E402
from peft_fastlora.ops.kv_cache import kv_cache_write  # noqa: E402
from peft_fastlora.ops.rotary import apply_rotary, cos_sin_halves, rotate_halves  # noqa: E402

# the cache is long enough for every replay's write to land in it (each replay advances the length)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, CACHE_LEN, FILLED = 4096, 32, 8, 128, 32, 2048, 200


@triton.jit
def _rotary_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, length_ptr, ticket_ptr,
    seq_len, num_q_heads, num_heads, half, max_len,
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, c_sb, c_ss, kc_sb, kc_sh, kc_ss,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    token = tl.program_id(0)
    b = (token // seq_len).to(tl.int64)
    s = token % seq_len
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < half
    c1, c2, s1, s2 = cos_sin_halves(cos_ptr, sin_ptr, b * c_sb + s * c_ss, half, offs_d, d_mask)
    start = tl.load(length_ptr)
    pos = start.to(tl.int64) + s

    is_q = heads < num_q_heads
    kh = tl.where(is_q, 0, heads - num_q_heads).to(tl.int64)
    qh = tl.where(is_q, heads, 0).to(tl.int64)
    src = tl.where(is_q[:, None], q_ptr + b * q_sb + qh[:, None] * q_sh + s * q_ss,
                   k_ptr + b * k_sb + kh[:, None] * k_sh + s * k_ss)
    dim = 2 * half
    cache_at = b * kc_sb + kh[:, None] * kc_sh + pos * kc_ss
    dst = tl.where(is_q[:, None], q_out_ptr + ((b * num_q_heads + qh[:, None]) * seq_len + s) * dim,
                   k_cache_ptr + cache_at)
    # positions past the cache are dropped, as ops.kv_cache does (one flag per head of the block)
    in_cache = (tl.zeros([BLOCK_H], dtype=tl.int64) + pos) < max_len
    mask = ((heads < num_heads) & (is_q | in_cache))[:, None] & d_mask[None, :]
    x1 = tl.load(src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    y1, y2 = rotate_halves(x1, x2, c1, c2, s1, s2, q_out_ptr.dtype.element_ty)
    tl.store(dst + offs_d[None, :], y1, mask=mask)
    tl.store(dst + half + offs_d[None, :], y2, mask=mask)
    # the value heads of this block's key heads: copied as they are
    v_mask = ((heads >= num_q_heads) & (heads < num_heads) & in_cache)[:, None] & d_mask[None, :]
    v_src = v_ptr + b * v_sb + kh[:, None] * v_sh + s * v_ss
    v_dst = v_cache_ptr + cache_at
    tl.store(v_dst + offs_d[None, :], tl.load(v_src + offs_d[None, :], mask=v_mask), mask=v_mask)
    tl.store(v_dst + half + offs_d[None, :], tl.load(v_src + half + offs_d[None, :], mask=v_mask), mask=v_mask)
    # the last program to take the ticket (after every program has read the length) advances it
    programs = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == programs - 1:
        tl.store(length_ptr, start + seq_len)
        tl.atomic_xchg(ticket_ptr, 0)


def rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, length, ticket):
    """``ops.rotary`` then ``ops.kv_cache_write(..., ticket)`` in one launch; returns rotated q."""
    bsz, num_q, seq, dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_heads = num_q + k.shape[1]
    block_h = min(16, triton.next_power_of_2(num_heads))
    c_sb = cos.stride(0) if cos.shape[0] == bsz else 0
    use_pdl = pdl.mode(q)
    _rotary_kv_write_kernel[(bsz * seq, triton.cdiv(num_heads, block_h))](
        q, k, v, cos, sin, q_out, k_cache, v_cache, length, ticket,
        seq, num_q, num_heads, dim // 2, k_cache.shape[2],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), c_sb, cos.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(max(dim // 2, 1)), USE_PDL=use_pdl, num_warps=4,
        enable_fp_fusion=False, launch_pdl=use_pdl > 0)
    return q_out


def _layer_inputs(bsz, heads, kv_heads, dim, cache_len, filled, device, dtype, hidden=None):
    """One layer's step: a fused q/k/v output and its views, cos / sin, caches, length, ticket."""
    qkv = torch.randn(bsz, 1, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    shape = (bsz, 1, -1, dim)
    q = qkv[..., : heads * dim].view(shape).transpose(1, 2)
    k = qkv[..., heads * dim: (heads + kv_heads) * dim].view(shape).transpose(1, 2)
    v = qkv[..., (heads + kv_heads) * dim:].view(shape).transpose(1, 2)
    ang = torch.rand(bsz, 1, dim, device=device) * 6.28
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    caches = [torch.randn(bsz, kv_heads, cache_len, dim, device=device, dtype=dtype) for _ in range(2)]
    length = torch.full((1,), filled, dtype=torch.int64, device=device)
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    return dict(qkv=qkv, q=q, k=k, v=v, cos=cos, sin=sin, k_cache=caches[0], v_cache=caches[1], length=length,
                ticket=ticket)


def check(bsz, heads, kv_heads, dim, cache_len, filled, device, dtype):
    """The one kernel's q, caches and length equal the two kernels' exactly."""
    a = _layer_inputs(bsz, heads, kv_heads, dim, cache_len, filled, device, dtype)
    b = {n: (t.clone() if isinstance(t, torch.Tensor) and n in ("k_cache", "v_cache", "length", "ticket") else t)
         for n, t in a.items()}
    q_two, k_two = apply_rotary(a["q"], a["k"], a["cos"], a["sin"])
    kv_cache_write(k_two, a["v"], a["k_cache"], a["v_cache"], a["length"], ticket=a["ticket"])
    q_one = rotary_kv_write(b["q"], b["k"], b["v"], b["cos"], b["sin"], b["k_cache"], b["v_cache"], b["length"],
                            b["ticket"])
    for name, x, y in (("q", q_two, q_one), ("k cache", a["k_cache"], b["k_cache"]),
                       ("v cache", a["v_cache"], b["v_cache"]), ("length", a["length"], b["length"]),
                       ("ticket", a["ticket"], b["ticket"])):
        if not torch.equal(x, y):
            raise AssertionError(f"{name}: the one kernel differs from the two")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/probe_rotary_kv_h200.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): the equality check, tiny shapes")
    args = p.parse_args(argv)
    if args.smoke:
        for dtype in (torch.float32, torch.bfloat16):
            check(3, 4, 2, 16, 12, 5, "cpu", dtype)
            check(2, 4, 1, 8, 6, 6, "cpu", dtype)  # a full cache: nothing written, the length still advances
        print("smoke: the one kernel's q, caches and length equal the two kernels'")
        return 0
    from bench_kernels import capture, timer_and_bandwidth
    from peft_fastlora.ops.decode_attention import decode_attention
    from peft_fastlora.ops.stream_gemm import StreamConfig, StreamWorkspace, stream_gemm

    timer, _ = timer_and_bandwidth(args.iters)
    dtype, dev = torch.bfloat16, "cuda"
    n_qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    weights = [torch.randn(n_qkv, HIDDEN, device=dev, dtype=dtype) / HIDDEN ** 0.5 for _ in range(LAYERS)]
    rows = []
    for bsz in args.batches:
        check(bsz, HEADS, KV_HEADS, HEAD_DIM, CACHE_LEN, FILLED, dev, dtype)
        x = torch.randn(bsz, 1, HIDDEN, device=dev, dtype=dtype)
        layers = [_layer_inputs(bsz, HEADS, KV_HEADS, HEAD_DIM, CACHE_LEN, FILLED, dev, dtype) for _ in range(LAYERS)]
        pos = torch.arange(CACHE_LEN, device=dev)
        mask = (pos < FILLED + 1)[None, None, None, :].expand(bsz, 1, 1, CACHE_LEN).contiguous()
        work = StreamWorkspace(dev, 4 * bsz * n_qkv, n_qkv)
        cfg = StreamConfig(block_n=64, block_k=128, num_warps=4, num_stages=6)

        def gemm(w, out):
            if bsz <= 64:
                stream_gemm(x.view(bsz, HIDDEN), w, out=out.view(bsz, -1), config=cfg, workspace=work, check=False)
            else:
                torch.matmul(x.view(bsz, HIDDEN), w.T, out=out.view(bsz, -1))

        def step(fused):
            for w, L in zip(weights, layers):
                gemm(w, L["qkv"])
                if fused:
                    q = rotary_kv_write(L["q"], L["k"], L["v"], L["cos"], L["sin"], L["k_cache"], L["v_cache"],
                                        L["length"], L["ticket"])
                else:
                    q, k = apply_rotary(L["q"], L["k"], L["cos"], L["sin"])
                    kv_cache_write(k, L["v"], L["k_cache"], L["v_cache"], L["length"], ticket=L["ticket"])
                decode_attention(q, L["k_cache"], L["v_cache"], mask)

        times = {}
        for name, fused in (("two_kernels", False), ("one_kernel", True)):
            graph = capture(lambda: step(fused))
            times[name] = timer(graph.replay) / LAYERS
            del graph
        for name, us in times.items():
            rows.append(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                             batch=bsz, chain=f"qkv gemm + {name.replace('_', ' ')} + attention", impl=name,
                             us_per_layer=round(us, 2),
                             vs_two_kernels=round(us / times["two_kernels"], 3)))
        print(f"b{bsz:<4d} two kernels {times['two_kernels']:7.2f} us a layer, one kernel {times['one_kernel']:7.2f}",
              flush=True)
    return bg.write_out(rows, args.out)


if __name__ == "__main__":
    sys.exit(main())
