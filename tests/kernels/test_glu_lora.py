"""The one-launch LoRA gate/up (``ops.glu_lora``) against its torch reference in Triton's interpreter:
mixed ranks, an adapter on one module only, rows of no adapter, free arena rows holding NaN (never
read into a result), rows not a whole tile; the counters back at zero after each launch; the tiles'
own shrink (a tile that stops waiting) equal to the shrink programs'; bad operands refused.
``test_glu_lora_gpu.py`` runs the 8B shapes on the GPU."""

import pytest
import torch

import peft_fastlora.ops.glu_lora as gl
from peft_fastlora.ops.glu_lora import GluLora, glu_lora, glu_lora_reference, glu_lora_shrink_reference
from peft_fastlora.kernel_support import interpreting
from peft_fastlora.ops.tma_gemm import TmaConfig

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
CONFIG = TmaConfig(32, 32, 1, 4, 2)


def glu_case(m, n, k, slot_ranks, dtype, device="cpu", gap=8, seed=0, row_slots=None):
    """x, w = [gate; up; arena] and a ``GluLora`` laid out as ``lora.pool`` lays a gate/up site out:
    module j's region of the arena holds each slot's block (``slot_ranks[s][j]`` rows, none for rank
    0) with ``gap`` free rows after each, which hold NaN, as does B's free space. Rows take the slots
    in turn and every third row none (or ``row_slots``)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    slots = len(slot_ranks)
    caps = [sum(r[j] + gap for r in slot_ranks if r[j]) or 8 for j in range(2)]
    r_total = sum(caps)
    a_rows = torch.zeros(slots, 2, dtype=torch.int32)
    b_offs = torch.zeros(slots, 2, dtype=torch.int64)
    col_slot = torch.full((r_total,), -1, dtype=torch.int32)
    w = torch.randn(2 * n + r_total, k, generator=g) / k ** 0.5
    w[2 * n:] = float("nan")
    b_padded = torch.full((r_total * n + 64,), float("nan"))  # (the kernel may read MAX_RANK past the end)
    b = b_padded[: r_total * n]
    for j in range(2):
        row = caps[0] * j
        for s, ranks in enumerate(slot_ranks):
            r = ranks[j]
            if not r:
                continue
            a_rows[s, j], b_offs[s, j] = row, row * n
            col_slot[row: row + r] = s
            w[2 * n + row: 2 * n + row + r] = torch.randn(r, k, generator=g) / k ** 0.5
            b[row * n: (row + r) * n] = torch.randn(n * r, generator=g) / r ** 0.5
            row += r + gap
    ranks = torch.tensor(slot_ranks, dtype=torch.int32)
    scalings = torch.tensor([[0.5 + s, 2.0 - 0.25 * s] for s in range(slots)], dtype=torch.float32)
    if row_slots is None:
        row_slots = [-1 if i % 3 == 2 else i % slots for i in range(m)]
    x = torch.randn(m, k, generator=g)
    to = dict(device=device)
    aligned = all(r % 8 == 0 for pair in slot_ranks for r in pair) and gap % 8 == 0
    lora = GluLora(torch.tensor(row_slots + [5] * 3, dtype=torch.int32, **to), col_slot.to(**to), caps[0],
                   b_padded.to(dtype=dtype, **to)[: r_total * n], ranks.to(**to), scalings.to(**to), a_rows.to(**to),
                   b_offs.to(**to), torch.full((m, r_total + 64), float("nan"), dtype=dtype, **to),
                   torch.zeros(2, dtype=torch.int32, **to),
                   max(r for pair in slot_ranks for r in pair), 8 if aligned else 1)
    return x.to(dtype=dtype, **to), w.to(dtype=dtype, **to), lora


def with_bt(lora, n):
    """``lora`` with ``bt``: B's columns laid out as the arena's rows (zeros in free and padding
    columns), built from its tables."""
    r, t0 = lora.col_slot.shape[0], lora.t0
    t0_pad = -(-t0 // gl.TAIL_BLOCK) * gl.TAIL_BLOCK
    bt = torch.zeros(n, -(-(t0_pad + r - t0) // 8) * 8, dtype=lora.b.dtype, device=lora.b.device)
    for c in (lora.col_slot >= 0).nonzero().flatten().tolist():
        sl, j = int(lora.col_slot[c]), int(c >= t0)
        rank, first, off = int(lora.ranks[sl, j]), int(lora.a_rows[sl, j]), int(lora.b_offs[sl, j])
        bt[:, c if c < t0 else t0_pad + c - t0] = lora.b[off: off + n * rank].view(n, rank)[:, c - first]
    return lora._replace(bt=bt, t0_pad=t0_pad)


def truncated(t):
    """float32 to bfloat16's values as Triton's interpreter casts: the low 16 bits dropped."""
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def assert_within_a_unit(got, want, name):
    """Each of ``got`` within one bfloat16 unit (of the last place) of ``want`` (float32 tensors)."""
    unit = torch.ldexp(torch.ones_like(want), torch.frexp(want)[1] - 8)
    off = (got - want).abs() > unit
    assert not off.any(), f"{name}: {int(off.sum())} values more than a bfloat16 unit off, first at " \
        f"{tuple(off.nonzero()[0].tolist())}"


def check_against_reference(x, w, n, lora, act, dtype, config=CONFIG, **kwargs):
    """The kernel's output the reference's, and the counters back at zero. In the interpreter a
    bfloat16 result is held to the reference in the interpreter's (truncating) roundings (below);
    elsewhere to ``TOL``."""
    out = torch.full((x.shape[0], n), float("nan"), dtype=dtype, device=x.device)
    glu_lora(x, w, n, lora, act, config, out=out, **kwargs)
    assert not lora.counters.any(), lora.counters  # put back for the next launch
    if interpreting() and dtype == torch.bfloat16:
        # in the interpreter's (truncating) roundings. Its float32 dots (numpy's) and torch's matmul
        # sum in orders that depend on the machine's BLAS, so a sum at a truncation boundary may land
        # one bfloat16 unit away: the shrink and the output are held to one unit each, and the
        # output, from the kernel's own shrink, to the reference's bits in all but a few places
        m, r = x.shape[0], w.shape[0] - 2 * n
        shrink = lora.scratch[:m, :r].float()
        assert_within_a_unit(shrink, glu_lora_shrink_reference(x, w, n, lora, rounding=truncated), "shrink")
        want = glu_lora_reference(x, w, n, lora, act, rounding=truncated, shrink=shrink).float()
        assert_within_a_unit(out.float(), want, "output")
        assert (out.float() != want).float().mean() <= 0.01, "more than 1% of the outputs are off the reference's bits"
        return out
    want = glu_lora_reference(x, w, n, lora, act)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)
    return out


RANKS = {"odd": [(8, 8), (4, 0), (16, 8)], "aligned": [(8, 8), (16, 0), (40, 8)]}


@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(3, 40, 96), (70, 33, 64)])
def test_matches_reference(m, n, k, dtype, ranks):
    """Mixed ranks, one adapter on gate only (a rank of 4: places not multiples of 8; or all
    multiples of 8, 16-byte loads, a rank past one K block of 32); NaN in the free rows of A and
    B; outputs not a whole tile."""
    x, w, lora = glu_case(m, n, k, RANKS[ranks], dtype)
    out = check_against_reference(x, w, n, lora, "silu", dtype)
    # the deltas are there: without them the result is the base model's
    base = glu_lora_reference(x, w, n, lora._replace(col_slot=torch.full_like(lora.col_slot, -1)), "silu")
    assert (out.float() - base.float()).abs().max() > 0.05


SHRINK_SIZES = {"16-row-shrink": {}, "64-row-shrink": dict(shrink_columns=64)}  # the shrink programs


@pytest.mark.parametrize("form", sorted(SHRINK_SIZES))
@pytest.mark.parametrize("ranks", [RANKS["odd"], [(8, 40), (0, 16)]], ids=["gate-wider", "up-wider"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_b_columns_through_a_descriptor_match_reference(dtype, ranks, form):
    """``bt`` given: the tail reads B's columns through a tensor descriptor; the same result,
    whichever module's region is the wider, with shrink programs of 16 rows or 64."""
    x, w, lora = glu_case(70, 33, 64, ranks, dtype)
    check_against_reference(x, w, 33, with_bt(lora, 33), "silu", dtype, **SHRINK_SIZES[form])


def test_b_columns_kernel_lays_b_out_as_the_arena_rows():
    """``b_columns`` writes what ``with_bt`` builds on the host, zeros over NaN in the free and
    padding columns."""
    for ranks in RANKS.values():
        _, _, lora = glu_case(3, 40, 32, ranks, torch.float32)
        want = with_bt(lora, 40)
        got = torch.full_like(want.bt, float("nan"))
        gl.b_columns(want.b, want.col_slot, want.ranks, want.a_rows, want.b_offs, want.t0, want.t0_pad, got)
        assert torch.equal(got, want.bt)


def test_gelu_tanh_and_a_second_launch():
    """GELU-tanh; a second launch with other rows' slots on the same counters and scratch."""
    x, w, lora = glu_case(20, 24, 32, [(8, 8), (8, 16)], torch.float32, gap=0)
    check_against_reference(x, w, 24, lora, "gelu_tanh", torch.float32)
    lora.token_slot[:20] = torch.tensor([1, 0, -1, 1] * 5, dtype=torch.int32)
    check_against_reference(x, w, 24, lora, "gelu_tanh", torch.float32)


def test_rows_of_no_adapter_get_the_base_output():
    x, w, lora = glu_case(9, 16, 32, [(8, 8)], torch.float32, row_slots=[-1] * 9)
    out = check_against_reference(x, w, 16, lora, "silu", torch.float32)
    base = torch.nn.functional.silu(x @ w[:16].T) * (x @ w[16:32].T)
    torch.testing.assert_close(out, base, atol=1e-5, rtol=1e-5)


def test_tiles_that_stop_waiting_compute_the_shrink_themselves():
    """The guard against a launch whose shrink programs do not run first: a tile that has polled
    ``SPIN_LIMIT`` times writes the whole shrink to the scratch itself. Here the count never reaches
    the shrink programs' number: the launch ends, its result is the waiting launch's, the counters
    are back at zero. (The interpreter runs the shrink programs first, so the tiles' rewrite is the
    same bits; ``test_glu_lora_gpu.py`` lets them race.)"""
    x, w, lora = glu_case(70, 40, 64, [(8, 8), (4, 0), (16, 8)], torch.float32)
    waited = check_against_reference(x, w, 40, lora, "silu", torch.float32)
    lora.counters[0] = -1000
    lora.scratch.fill_(float("nan"))
    alone = glu_lora(x, w, 40, lora, "silu", CONFIG, spin_limit=0)
    assert not lora.counters.any(), lora.counters
    torch.testing.assert_close(alone, waited, atol=1e-5, rtol=1e-5)


def test_reference_holds_to_peft_style_math():
    """The reference itself against the plain formula per row: base + scaling * B(A x) per module."""
    n = 16
    x, w, lora = glu_case(5, n, 32, [(8, 8), (4, 0)], torch.float32, gap=0, row_slots=[0, 1, -1, 1, 0])
    want = []
    for i, s in enumerate([0, 1, -1, 1, 0]):
        gate, up = x[i] @ w[:n].T, x[i] @ w[n:2 * n].T
        if s >= 0:
            outs = [gate, up]
            for j in range(2):
                r = int(lora.ranks[s, j])
                if r:
                    a = w[2 * n + int(lora.a_rows[s, j]): 2 * n + int(lora.a_rows[s, j]) + r]
                    bm = lora.b[int(lora.b_offs[s, j]): int(lora.b_offs[s, j]) + n * r].view(n, r)
                    outs[j] = outs[j] + float(lora.scalings[s, j]) * (bm @ (a @ x[i]))
            gate, up = outs
        want.append(torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(glu_lora_reference(x, w, n, lora, "silu"), torch.stack(want), atol=1e-5, rtol=1e-5)


def test_bad_operands_are_refused():
    x, w, lora = glu_case(4, 16, 32, [(8, 8)], torch.float32)
    cases = [
        (lambda: glu_lora(x.double(), w, 16, lora, "silu", CONFIG), "dtype"),
        (lambda: glu_lora(torch.randn(129, 32), w, 16, lora, "silu", CONFIG), "at most 128"),
        (lambda: glu_lora(x, w[:32], 16, lora, "silu", CONFIG), "arena rows"),
        (lambda: glu_lora(x, w, 16, lora._replace(col_slot=lora.col_slot[1:]), "silu", CONFIG), "col_slot"),
        (lambda: glu_lora(x, w, 16, lora._replace(t0=10 ** 6), "silu", CONFIG), "t0"),
        (lambda: glu_lora(x, w, 16, lora._replace(token_slot=lora.token_slot[:2]), "silu", CONFIG), "token_slot"),
        (lambda: glu_lora(x, w, 16, lora._replace(ranks=lora.ranks.long()), "silu", CONFIG), "tables"),
        (lambda: glu_lora(x, w, 16, lora._replace(scratch=lora.scratch[:, :-1]), "silu", CONFIG), "scratch"),
        (lambda: glu_lora(x, w, 16, lora._replace(b=lora.b.clone()), "silu", CONFIG), "padded"),
        (lambda: glu_lora(x, w, 16, lora._replace(counters=torch.zeros(3, dtype=torch.int32)), "silu", CONFIG),
         "counters"),
        (lambda: glu_lora(x, w, 16, lora, "relu", CONFIG), "activation"),
        (lambda: glu_lora(x, w, 16, lora._replace(align=4), "silu", CONFIG), "align"),
        (lambda: glu_lora(x, w, 16, with_bt(lora, 16)._replace(t0_pad=3), "silu", CONFIG), "bt"),
        (lambda: glu_lora(x, w, 16, lora, "silu", CONFIG, out=torch.empty(4, 15)), "out"),
        (lambda: glu_lora(x, w, 16, lora, "silu", CONFIG, spin_limit=-1), "spin_limit"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            bad()
