"""The paged varlen attention kernel (``ops/paged_varlen.py``) under Triton's interpreter.

Against the torch reference (``paged_varlen_reference``, through the page table): decode rows,
prefill chunks with history and whole prompts in one step, grouped heads (1, 2, 3 and 4 query
heads a kv head: a group that is not a power of two pads its rows), left windows, one split and
several, pages of 1, 4, 5 and 64 slots handed out in a random order inside a larger cache (a
request's last page partly filled), padded requests with no queries and padded query rows past
the last request (left zero), head dims 16 and 24. fp32 and fp16 here
(the interpreter keeps bf16 as raw bits); bf16 is the GPU tier's.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from peft_fastlora.base_ops.paged_attention import varlen_reference  # noqa: E402
from peft_fastlora.ops import paged_varlen as pv  # noqa: E402
from peft_fastlora.kernel_support import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU tests run under TRITON_INTERPRET=1")

# (dtype, atol, rtol): both sides accumulate in fp32; fp32 differs by summation order, fp16 by the
# rounding of the probabilities fed to the second product and of the output
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3)}


def _case(q_lens, k_lens, heads, kv_heads, dim, dtype, seed, pad_tokens=0, pad_seqs=0, page=4):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()) + [sum(q_lens)] * pad_seqs,
                        dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0).tolist()) + [sum(k_lens)] * pad_seqs,
                        dtype=torch.int32)
    pages = random_pages(k_lens, page, g, pad_seqs)
    slots = int(pages.starts.max()) + page
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens) + pad_tokens, heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, pages, cu_q, cu_k


def random_pages(k_lens, page, g, pad_seqs=0) -> pv.Pages:
    """Each request's keys on pages of ``page`` slots, the pages drawn in a random order from a
    cache three times as large as the keys need."""
    counts = [-(-k // page) for k in k_lens]
    order = torch.randperm(3 * sum(counts) + 2, generator=g)[:sum(counts)]
    cu = [0] + torch.tensor(counts).cumsum(0).tolist()
    return pv.Pages((order * page).to(torch.int32), torch.tensor(cu + [cu[-1]] * pad_seqs, dtype=torch.int32), page)


def _reference(q, k_cache, v_cache, pages, cu_q, cu_k, scale, window):
    return pv.paged_varlen_reference(q.float(), k_cache.float(), v_cache.float(), pages, cu_q, cu_k, scale,
                                     window)


@pytest.mark.parametrize("page", [1, 4, 5])
def test_the_reference_reads_the_keys_its_pages_name(page):
    """The reference through a page table equals the per-request reference on the keys gathered
    slot by slot."""
    k_lens = [6, 4, 9]
    q, kc, vc, pages, cu_q, cu_k = _case([1, 4, 2], k_lens, 4, 2, 16, torch.float32, seed=2, pad_tokens=2,
                                         page=page)
    slots = torch.cat([torch.tensor([int(pages.starts[int(pages.cu[i]) + j // page]) + j % page for j in range(k)])
                       for i, k in enumerate(k_lens)])
    assert len(set(slots.tolist())) == sum(k_lens)  # no two keys on one slot
    gathered = varlen_reference(q, kc[slots], vc[slots], cu_q.long(), cu_k.long(), 0.25, 2)
    torch.testing.assert_close(pv.paged_varlen_reference(q, kc, vc, pages, cu_q, cu_k, 0.25, 2), gathered)


def _check(q_lens, k_lens, heads, kv_heads, dim, dtype, window=-1, seed=0, pad_tokens=0, pad_seqs=0, splits=None,
           monkeypatch=None, page=4):
    q, kc, vc, pages, cu_q, cu_k = _case(q_lens, k_lens, heads, kv_heads, dim, dtype, seed, pad_tokens, pad_seqs, page)
    if splits is not None:
        config = pv.paged_varlen_config
        monkeypatch.setattr(pv, "paged_varlen_config", lambda *a: {**config(*a), "SPLITS": splits})
    scale = 1 / math.sqrt(dim)
    got = pv.paged_varlen_attention(q, kc, vc, pages, cu_q, cu_k, max(q_lens), max(k_lens), scale, window)
    want = _reference(q, kc, vc, pages, cu_q, cu_k, scale, window)
    atol, rtol = TOLERANCES[dtype]
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    if pad_tokens:
        assert not got[sum(q_lens):].any()  # padded query rows stay zero
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 2), (8, 4)])
def test_decode_rows_equal_the_reference(dtype, heads, kv_heads):
    """One query per request (the engine's decode-only steps: one query a block)."""
    _check([1, 1, 1, 1], [9, 1, 40, 17], heads, kv_heads, 16, dtype, seed=heads + kv_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("window, page", [(-1, 4), (6, 5), (-1, 1), (-1, 64)])
def test_mixed_steps_equal_the_reference(dtype, window, page):
    """Decode rows, a prefill chunk with history, a whole prompt and a chunk longer than a query
    block in one step, with padded requests and padded query rows; pages smaller than a key tile,
    not dividing it, and larger than every request."""
    _check([1, 5, 9, 1, 23], [12, 5, 30, 1, 23], 8, 2, 16, dtype, window=window, seed=7, pad_tokens=3, pad_seqs=2,
           page=page)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_splits_merge_to_the_same_output(splits, monkeypatch):
    """The keys cut into ranges per split, merged by their log-sum-exp: the same as one pass, with
    ranges left empty where a request has fewer key blocks than splits."""
    _check([1, 3, 1], [70, 35, 2], 4, 2, 16, torch.float32, seed=11, splits=splits, monkeypatch=monkeypatch)


def test_head_dim_padded_and_a_strided_query():
    """A head dim that is not a power of two (24: padded to 32 in the tile) and q as the engine
    hands it, a transposed view of (1, H, Tq, D)."""
    q, kc, vc, pages, cu_q, cu_k = _case([1, 6], [10, 6], 4, 2, 24, torch.float32, seed=3)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)  # (Tq, H, D) with the engine's strides
    assert not q_view.is_contiguous()
    got = pv.paged_varlen_attention(q_view, kc, vc, pages, cu_q, cu_k, 6, 10, 0.2)
    torch.testing.assert_close(got, _reference(q, kc, vc, pages, cu_q, cu_k, 0.2, -1), atol=2e-5, rtol=2e-5)


def test_the_grid_is_set_by_shapes_only():
    """Tiles and splits come from host ints (the same for every replay of a captured shape): the
    requests with one query always take the singles' launch (G rows padded to 16); a step whose
    bound allows more takes a second launch of 64-row blocks; splits never exceed the key blocks."""
    cpu = torch.device("cpu")
    decode = pv.paged_varlen_config(32, 32, 8, 4, 1, 500, cpu)
    assert decode["SINGLE_M"] == 16 and decode["blocks"] == 0
    mixed = pv.paged_varlen_config(300, 40, 8, 4, 200, 500, cpu)
    assert mixed["BLOCK_Q"] * mixed["G_PAD"] == 64 and mixed["blocks"] == 300 // mixed["BLOCK_Q"] + 40
    assert pv.paged_varlen_config(4, 4, 1, 1, 1, 3, cpu)["SPLITS"] == 1


def test_decode_rows_under_a_padded_bound(monkeypatch):
    """A graphed decode step: every request has one query, but the bound the engine passes is the
    padded token count. The blocks' launch finds nothing to do; the singles' launch serves all."""
    launches = []
    kernel = pv._paged_varlen_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((grid, meta["SINGLES"]))
                return kernel[grid](*args, **meta)
            return launch

    monkeypatch.setattr(pv, "_paged_varlen_kernel", Spy())
    q, kc, vc, pages, cu_q, cu_k = _case([1, 1, 1], [7, 30, 2], 8, 2, 16, torch.float32, seed=5, pad_tokens=5,
                                       pad_seqs=2)
    got = pv.paged_varlen_attention(q, kc, vc, pages, cu_q, cu_k, 8, 30, 0.25)
    torch.testing.assert_close(got, _reference(q, kc, vc, pages, cu_q, cu_k, 0.25, -1), atol=2e-5, rtol=2e-5)
    assert [singles for _, singles in launches] == [1, 2]


def test_bad_shapes_are_refused():
    q, kc, vc, pages, cu_q, cu_k = _case([1], [4], 6, 4, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="not a multiple"):
        pv.paged_varlen_attention(q, kc, vc, pages, cu_q, cu_k, 1, 4, 0.25)
    q, kc, vc, pages, cu_q, cu_k = _case([1], [4], 4, 2, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="head dimension .* must be contiguous"):
        pv.paged_varlen_attention(q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, pages, cu_q, cu_k, 1, 4,
                                  0.25)
