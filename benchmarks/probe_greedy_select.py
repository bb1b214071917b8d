"""The greedy token selection alone: ``ops.greedy_select`` at its block sizes and warps against
what transformers' loop runs for it (the float32 copy of the logits, ``argmax``, the padding of
finished rows, the EOS ``isin``), at an 8B vocabulary (128,256) in bf16.

Each variant is captured in a CUDA graph of ``--chain`` launches on distinct logits (so the time is
the GPU's, not the host's launch rate) and timed as replays; "per launch" is the replay over the
chain. The byte floor is the logits' bytes over the copy bandwidth.

``two_pass`` (probe only; session 35's lead): the library kernel's keys without its atomics. Each
program stores its chunk's best key to a (rows, chunks) buffer, and a second launch takes each
row's largest. It leaves out the stop ids and the pad (a few scalar ops of the second launch);
every variant's tokens are first checked against ``argmax``. ``--smoke`` runs that check alone
on the CPU (Triton's interpreter), with ties, NaN, infinities and signed zeros.

    python benchmarks/probe_greedy_select.py --out benchmarks/results/probe_greedy_select_h200.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VOCAB = 128256
EMPTY_KEY = -(2 ** 63)


@triton.jit
def _chunk_keys_kernel(logits_ptr, keys_ptr, vocab, stride_lr, n_chunks, EMPTY: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1: a program's best key (``ops.greedy_select``'s packing), stored, no atomics."""
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < vocab
    x = tl.load(logits_ptr + row * stride_lr + cols, mask=ok, other=float("-inf")).to(tl.float32) + 0.0
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(x != x, 0x7FFFFFFF, key)
    low32 = tl.full([], 0xFFFFFFFF, tl.int64)
    packed = tl.where(ok, (key.to(tl.int64) << 32) + (low32 - cols.to(tl.int64)), EMPTY)
    tl.store(keys_ptr + row * n_chunks + chunk, tl.max(packed, axis=0))


@triton.jit
def _pick_kernel(keys_ptr, token_ptr, rows, n_chunks, EMPTY: tl.constexpr, ROWS: tl.constexpr,
                 CHUNKS: tl.constexpr):
    """Pass 2: ``ROWS`` rows a program, each row's largest chunk key turned back into its column."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, CHUNKS)
    mask = (r < rows)[:, None] & (c < n_chunks)[None, :]
    keys = tl.load(keys_ptr + r.to(tl.int64)[:, None] * n_chunks + c[None, :], mask=mask, other=EMPTY)
    best = tl.max(keys, axis=1)
    low32 = tl.full([], 0xFFFFFFFF, tl.int64)
    tl.store(token_ptr + r, low32 - (best & low32), mask=r < rows)


def two_pass(logits, tokens, keys, block: int, warps: int, rows_per_program: int = 8):
    rows, vocab = logits.shape
    n_chunks = triton.cdiv(vocab, block)
    _chunk_keys_kernel[(n_chunks, rows)](logits, keys, vocab, logits.stride(0), n_chunks, EMPTY=EMPTY_KEY,
                                         BLOCK=block, num_warps=warps)
    _pick_kernel[(triton.cdiv(rows, rows_per_program),)](keys, tokens, rows, n_chunks, EMPTY=EMPTY_KEY,
                                                         ROWS=rows_per_program,
                                                         CHUNKS=max(2, triton.next_power_of_2(n_chunks)), num_warps=1)
    return tokens


def smoke() -> int:
    """The two-pass variant's tokens against ``argmax`` under the interpreter (a small vocabulary)."""
    vocab, block = 1000, 128
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(9, vocab).to(dtype)
        x[0, vocab - 1] = 50.0  # the last column, in the last, partial chunk
        x[1, 3], x[1, 700] = 50.0, 50.0  # a tie across chunks: the first wins
        x[2, 5], x[2, 9] = 50.0, 50.0  # a tie in one chunk
        x[3] = float("-inf")
        x[4, 600], x[4, 200] = float("nan"), float("nan")  # the first NaN wins
        x[5] = -0.0
        x[5, 400] = 0.0  # -0.0 equals 0.0: column 0
        x[6, 10], x[6, 999] = float("inf"), float("inf")
        tokens = torch.empty(9, dtype=torch.long)
        keys = torch.empty(9, triton.cdiv(vocab, block), dtype=torch.long)
        got = two_pass(x, tokens, keys, block, 4, rows_per_program=4)
        want = torch.argmax(x.float(), dim=-1)
        assert torch.equal(got, want), (dtype, got, want)
    print("smoke: every variant ran and matched argmax")
    return 0


def _graph_time_us(fn, chain: int, iters: int = 50) -> float:
    fn(0)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(chain):
            fn(i)
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters / chain


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--chain", type=int, default=16)
    p.add_argument("--out", default="benchmarks/results/probe_greedy_select_h200.csv")
    p.add_argument("--smoke", action="store_true", help="the two-pass variant's check on the CPU (interpreter)")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke()
    if not torch.cuda.is_available():
        print("probe_greedy_select needs a CUDA GPU; nothing measured")
        return 0
    import peft
    import transformers

    from bench_generate import copy_bandwidth
    from peft_fastlora.ops import greedy_select as gs

    bw = copy_bandwidth()
    vers = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, peft=peft.__version__, copy_bw_tbs=round(bw / 1e12, 3))
    rows_out, defaults = [], (gs.BLOCK, gs.NUM_WARPS)
    for rows in args.rows:
        xs = [torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) for _ in range(args.chain)]
        tokens = torch.empty(rows, dtype=torch.long, device="cuda")
        unfinished = torch.ones(rows, dtype=torch.long, device="cuda")
        pad = torch.tensor(0, device="cuda")
        eos = torch.tensor([2], device="cuda")
        floor_us = 1e6 * rows * VOCAB * 2 / bw

        def hf(i):
            scores = xs[i].to(copy=True, dtype=torch.float32)
            nxt = torch.argmax(scores, dim=-1)
            nxt = nxt * unfinished + pad * (1 - unfinished)
            return unfinished & ~torch.isin(nxt, eos)

        variants = [("transformers", "copy+argmax+pad+isin", hf)]
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                def fused(i, block=block, warps=warps):
                    gs.BLOCK, gs.NUM_WARPS = block, warps
                    return gs.greedy_select(xs[i], tokens, unfinished, pad, eos)
                variants.append(("greedy_select", f"block={block} warps={warps}", fused))
        keys = torch.empty(rows, triton.cdiv(VOCAB, 1024), dtype=torch.long, device="cuda")
        for block in (2048, 4096, 8192):
            for warps in (4, 8):
                def two(i, block=block, warps=warps):
                    return two_pass(xs[i], tokens, keys, block, warps)
                variants.append(("two_pass", f"block={block} warps={warps}", two))
        for impl, config, fn in variants:
            if impl != "transformers":  # the tokens first
                unfinished.fill_(1)
                fn(0)
                want = torch.argmax(xs[0].float(), dim=-1)
                if not torch.equal(tokens, want):
                    print(f"rows {rows} {impl} {config}: tokens differ from argmax; not timed", flush=True)
                    continue
            try:
                us = _graph_time_us(fn, args.chain)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                print(f"rows {rows} {impl} {config}: {type(e).__name__}: {e}", flush=True)
                continue
            row = dict(vers, rows=rows, vocab=VOCAB, impl=impl, config=config, us_per_launch=round(us, 2),
                       byte_floor_us=round(floor_us, 2))
            print(row, flush=True)
            rows_out.append(row)
        gs.BLOCK, gs.NUM_WARPS = defaults
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        w.writeheader()
        w.writerows(rows_out)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
