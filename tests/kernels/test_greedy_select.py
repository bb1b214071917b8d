"""``ops.greedy_select`` against transformers' own steps in torch (``greedy_select_reference``),
under Triton's interpreter: fresh random logits, ties across and inside chunks, NaN, infinities,
signed zeros, suppressed and stop ids, finished rows, strided token outputs, and the workspace
left reset for the next launch. Comparisons are exact: the kernel must pick the same token."""

import pytest
import torch

from peft_fastlora.ops import greedy_select as gs
from peft_fastlora.ops.greedy_select import greedy_select, greedy_select_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B = gs.block_for(6)  # the block of the tests' few rows (2-6: one launch shape)


def _both(logits, unfinished=None, pad=None, stop=None, suppress=None, config=None):
    """(kernel tokens, reference tokens, kernel's unfinished after, reference's unfinished after)."""
    rows = logits.shape[0]
    un_k = None if unfinished is None else unfinished.clone()
    un_r = None if unfinished is None else unfinished.clone()
    got = greedy_select(logits, torch.empty(rows, dtype=torch.long), un_k, pad, stop, suppress, config=config)
    want = greedy_select_reference(logits, torch.empty(rows, dtype=torch.long), un_r, pad, stop, suppress)
    return got, want, un_k, un_r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", [(1, 5), (1, 2 * gs.block_for(1) + 1), (3, B), (2, B + 1), (5, 3 * B + 17),
                                         (17, 2 * gs.block_for(17) + 3)])
def test_random_logits_with_ties(dtype, rows, vocab):
    x = torch.randn(rows, vocab).to(dtype)
    top = x.max()
    x[0, vocab - 1] = top + 1  # the last column, alone at the top
    if rows > 1:  # a tie in two chunks: the first column wins
        x[1, vocab // 2], x[1, vocab - 1] = top + 2, top + 2
    if rows > 2:  # a tie inside one chunk
        x[2, 1], x[2, 3] = top + 3, top + 3
    got, want, *_ = _both(x)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_infinities_and_signed_zeros(dtype):
    vocab = 2 * B + 9
    x = torch.randn(6, vocab).to(dtype)
    x[0] = float("-inf")  # all -inf: column 0
    x[1, 5], x[1, B + 3] = float("nan"), float("nan")  # the first NaN wins
    x[2, B + 1] = float("inf")
    x[2, 7] = float("inf")  # the first +inf wins
    x[3] = -0.0
    x[3, B + 4] = 0.0  # -0.0 equals 0.0: column 0
    x[4] = 0.0
    x[4, 0] = -0.0
    x[5, 2 * B + 8] = float("nan")  # a NaN in the last, partial chunk
    got, want, *_ = _both(x)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stop_pad_and_suppress_follow_transformers(dtype):
    torch.manual_seed(1)
    rows, vocab = 6, B + 100
    x = torch.randn(rows, vocab).to(dtype)
    best = torch.argmax(x.float(), dim=-1)
    unfinished = torch.tensor([1, 0, 1, 1, 0, 1])
    pad = torch.tensor(3)
    stop = torch.tensor([int(best[0]), int(best[2]), 3])  # rows 0 and 2 finish; finished rows pad with 3
    suppress = torch.tensor([int(best[3]), int(best[4])])  # row 3's best is suppressed
    got, want, un_k, un = _both(x, unfinished, pad, stop, suppress)
    assert torch.equal(got, want) and torch.equal(un_k, un), (got, want, un_k, un)
    assert un.tolist() == [0, 0, 0, 1, 0, 1]
    assert got[1] == 3 and got[3] != best[3]


def test_tokens_into_a_column_of_the_ids_buffer_and_the_workspace_is_left_reset():
    ids = torch.full((4, 9), -1, dtype=torch.long)
    for col, (rows, vocab) in enumerate([(4, 3 * B), (2, 77), (4, B + 1), (3, 2 * B)]):
        x = torch.randn(rows, vocab)
        greedy_select(x, ids[:rows, col])
        assert torch.equal(ids[:rows, col], torch.argmax(x, dim=-1))
        ws = gs.workspace_for(x.device, rows)
        assert (ws.slots == gs.EMPTY_KEY).all() and (ws.tickets == 0).all()
    assert (ids[:, 4:] == -1).all()  # nothing written past the columns asked for


def test_bad_inputs_name_the_problem():
    x = torch.randn(2, 10)
    out = torch.empty(2, dtype=torch.long)
    with pytest.raises(ValueError, match="logits must be"):
        greedy_select(x[:, ::2], out)
    with pytest.raises(ValueError, match="logits must be"):
        greedy_select(x.long(), out)
    with pytest.raises(ValueError, match="tokens must be"):
        greedy_select(x, torch.empty(3, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens must be"):
        greedy_select(x, torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="stop ids need unfinished"):
        greedy_select(x, out, stop_ids=torch.tensor([1]))
    with pytest.raises(ValueError, match="at most 16"):
        greedy_select(x, out, suppress_ids=torch.arange(17))
    with pytest.raises(ValueError, match="int64"):
        greedy_select(x, out, suppress_ids=torch.tensor([1], dtype=torch.int32))
    for config in [(64, 24, 1, 1), (64, 16, 1), (64, 16, 0, 1), (64.0, 16, 1, 1)]:
        with pytest.raises(ValueError, match="config must be"):
            greedy_select(x, out, config=config)


def test_an_own_workspace_is_used_and_checked(monkeypatch):
    """A launch captured in a graph keeps its workspace's address: it can bring its own, which the
    shared one's growth never replaces."""
    x = torch.randn(3, 300)
    own = gs.SelectWorkspace(x.device, 3)
    tokens = torch.empty(3, dtype=torch.long)
    with monkeypatch.context() as m:
        m.setattr(gs, "workspace_for", lambda *a: pytest.fail("the shared workspace was asked for"))
        greedy_select(x, tokens, workspace=own)
    assert torch.equal(tokens, torch.argmax(x, dim=-1))
    assert (own.slots == gs.EMPTY_KEY).all() and (own.tickets == 0).all()  # left reset for the next launch
    with pytest.raises(ValueError, match="workspace of 2 rows for 3 rows"):
        greedy_select(x, tokens, workspace=gs.SelectWorkspace(x.device, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [(64, 16, 1, 1), (96, 32, 2, 2), (64, 64, 1, 1)])
def test_lanes_across_tiles_keep_argmax_rules(dtype, config):
    """Small segments and tiles (several tiles a segment, segments not a tile multiple, a partial
    last tile): a lane sees the same column offset in every tile, so ties, NaNs and signed zeros
    one tile apart must keep the first column, as within a tile."""
    seg, tile = config[:2]
    vocab = 3 * seg + tile // 2 + 5
    x = torch.randn(8, vocab).to(dtype)
    top = 40.0
    x[0, 3], x[0, 3 + tile], x[0, 3 + 2 * tile] = top, top, top  # a tie in one lane
    x[1, 5 + tile], x[1, 5 + 2 * tile] = float("nan"), float("nan")  # NaNs in one lane: the first
    x[2] = float("-inf")
    x[2, vocab - 1] = float("-inf")
    x[3] = -1.0
    x[3, 2], x[3, 2 + tile] = -0.0, 0.0  # the zeros tie: the first
    x[4, 1 + tile] = float("nan")
    x[4, 1] = float("inf")  # NaN beats +inf in the same lane
    x[5, vocab - 1] = top  # the partial last tile of the last segment
    x[6, seg + 7], x[6, 2 * seg + 7] = top, top  # a tie across segments, same lane offset
    x[7] = float("-inf")
    x[7, seg + tile - 1] = -1e30  # the only finite value, in one lane's later tile
    got, want, *_ = _both(x, config=config)
    assert torch.equal(got, want), (got, want)
