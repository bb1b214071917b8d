"""``lora.host_copy``: views filled from host tensors through one staged copy per host storage
(the path registered adapters take into GPU slots), run on the CPU by letting it stage there."""

import importlib

import pytest
import torch

from peft_fastlora import Tuning
from peft_fastlora.lora import host_copy

segment_copy_module = importlib.import_module("peft_fastlora.lora.host_copy")  # where the kernel is called


ON_CPU = Tuning(staged_devices=("cuda", "cpu"))  # staging on the CPU too


@pytest.fixture
def staged_on_cpu(monkeypatch):
    stages = []
    empty = torch.empty

    def counted(*args, **kwargs):
        stages.append(args[0] if args else kwargs.get("size"))
        return empty(*args, **kwargs)

    monkeypatch.setattr(host_copy.torch, "empty", counted)
    return stages


def _adapter(seed, dtype=torch.bfloat16):
    """One flat host buffer with an A (r, in) and B (out, r) pair per module as views of it."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(3 * 8 * 40 + 2 * 56 * 8, generator=g).to(dtype)
    views, at = [], 0
    for shape in ((8, 40), (56, 8), (8, 40), (56, 8), (8, 40)):
        n = shape[0] * shape[1]
        views.append(flat[at: at + n].view(shape))
        at += n
    return views


@pytest.mark.parametrize("staging_bytes", [256 << 20, 1200, 1], ids=["one_stage", "several", "each_own"])
def test_views_from_shared_host_storages(staged_on_cpu, monkeypatch, staging_bytes):
    """Two adapters' buffers (several views each), a lone tensor, a column slice (non-contiguous,
    as a tensor-parallel rank's part of A), a row slice and a destination of another dtype: dense
    views go through the segment copy, the others through batched copies; every destination
    equals its source,
    other arena memory is untouched, and a staging buffer is made per storage batch."""
    tuning = ON_CPU.replace(staging_bytes=staging_bytes)
    runs = []
    real = segment_copy_module.segment_copy
    monkeypatch.setattr(segment_copy_module, "segment_copy",
                        lambda src, segments, *a, **k: runs.append(len(segments) // 3) or real(src, segments, *a, **k))
    first, second = _adapter(1), _adapter(2)
    lone = torch.randn(5, 7).to(torch.bfloat16)
    arena = torch.full((4000,), 7.0, dtype=torch.bfloat16)
    sources = first + second[1:] + [lone, second[0][:, 10:30], first[1][20:40]]
    pairs, at = [], 0
    for src in sources:
        pairs.append((arena[at: at + src.numel()].view(src.shape), src))
        at += src.numel() + 3  # gaps the copies must not write
    cast = torch.zeros(first[4].shape, dtype=torch.float32)  # a stack of another dtype: cast on the way
    host_copy.copy_from_host(pairs + [(cast, first[4])], tuning=tuning)
    for dst, src in pairs:
        assert torch.equal(dst, src)
    assert torch.equal(cast, first[4].float())
    assert sum(runs) == 5 + 4 + 1, runs  # the dense views of the two buffers (the lone one copies directly)
    written = torch.zeros(4000, dtype=torch.bool)
    for dst, _ in pairs:
        start = dst.storage_offset()
        written[start: start + dst.numel()] = True
    assert (arena[~written] == 7.0).all(), "a copy wrote outside its view"
    expected = {256 << 20: 1, 1200: 2, 1: 2}[staging_bytes]  # the lone tensor copies directly
    assert len(staged_on_cpu) == expected, staged_on_cpu


def test_unstaged_device_copies_directly(monkeypatch):
    """Where staging does not pay (CPU by default), each view is copied from its source."""
    made = []
    empty = torch.empty
    monkeypatch.setattr(host_copy.torch, "empty", lambda *a, **k: made.append(a) or empty(*a, **k))
    src = _adapter(3)
    dst = [torch.zeros_like(t) for t in src]
    host_copy.copy_from_host(list(zip(dst, src)))
    assert all(torch.equal(d, s) for d, s in zip(dst, src)) and not made


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "direct"])
def test_runs_into_flat_buffers(monkeypatch, staged):
    """``HostRun``s (a registered adapter's dense weights bound for places in flat stack buffers,
    as pools make them): staged, one segment copy for the buffer's runs; else a copy per run
    through a view of its place. Both land exactly, and nothing between places is written."""
    from peft_fastlora.lora.pool import HostRun

    tuning = ON_CPU if staged else Tuning()
    views = _adapter(4)
    flat = views[0]._base if views[0]._base is not None else views[0]
    group = (flat.data_ptr() - flat.storage_offset() * flat.element_size(), torch.device("cpu"))
    arenas = [torch.full((1200,), 7.0, dtype=torch.bfloat16), torch.full((1000,), 7.0, dtype=torch.bfloat16)]
    runs, places, ends = [], [], [11, 5]
    for i, v in enumerate(views):
        dst, offset = arenas[i % 2], ends[i % 2]
        ends[i % 2] += v.numel() + 3  # gaps the copies must not write
        runs.append(HostRun(dst, offset, v, group, v.storage_offset(), v.numel()))
        places.append((dst, offset, v))
    assert all(end <= a.numel() for end, a in zip(ends, arenas))
    host_copy.copy_from_host([], runs, tuning=tuning)
    written = [torch.zeros(a.numel(), dtype=torch.bool) for a in arenas]
    for dst, offset, v in places:
        assert torch.equal(dst[offset: offset + v.numel()], v.reshape(-1))
        written[0 if dst is arenas[0] else 1][offset: offset + v.numel()] = True
    assert all((a[~w] == 7.0).all() for a, w in zip(arenas, written)), "a run wrote outside its place"


@pytest.mark.parametrize("staging_bytes", [256 << 20, 5000], ids=["both", "first_only"])
def test_prestaged_buffers_fill_their_runs(monkeypatch, staging_bytes):
    """``prestage`` queues whole buffers before the pools place them; ``copy_from_host`` then
    fills those buffers' runs from that staging (one segment copy per staging buffer, none of
    its own stages for them), and a buffer past ``prestage_bytes`` takes the usual path. Every
    run lands exactly, and nothing between places is written."""
    from peft_fastlora.lora.pool import HostRun, _storage_address

    tuning = ON_CPU.replace(prestage_bytes=staging_bytes)
    own_stages, launches = [], []
    stage = host_copy._staged_copy
    monkeypatch.setattr(host_copy, "_staged_copy", lambda groups: own_stages.append(len(groups)) or stage(groups))
    real = segment_copy_module.segment_copy
    monkeypatch.setattr(segment_copy_module, "segment_copy",
                        lambda src, segments, *a, **k: launches.append(len(segments) // 3) or real(src, segments, *a, **k))
    adapters = [_adapter(5), _adapter(6)]
    buffers = [v[0]._base if v[0]._base is not None else v[0] for v in adapters]
    prestaged = host_copy.prestage(buffers, torch.device("cpu"), tuning)
    assert set(prestaged) == ({_storage_address(b) for b in buffers} if staging_bytes > 5000
                              else {_storage_address(buffers[0])})
    arena = torch.full((4000,), 7.0, dtype=torch.bfloat16)
    runs, places, end = [], [], 9
    for views, flat in zip(adapters, buffers):
        group = (_storage_address(flat), torch.device("cpu"))
        for v in reversed(views):  # places in another order than the buffer's
            runs.append(HostRun(arena, end, v, group, v.storage_offset(), v.numel()))
            places.append((end, v))
            end += v.numel() + 5
    assert end <= arena.numel()
    host_copy.copy_from_host([], runs, prestaged, tuning)
    written = torch.zeros(arena.numel(), dtype=torch.bool)
    for offset, v in places:
        assert torch.equal(arena[offset: offset + v.numel()], v.reshape(-1))
        written[offset: offset + v.numel()] = True
    assert (arena[~written] == 7.0).all(), "a run wrote outside its place"
    if staging_bytes > 5000:
        assert own_stages == [] and launches == [10], (own_stages, launches)
    else:  # the second buffer: staged on its own, its runs in a segment copy of their own
        assert own_stages == [1] and sorted(launches) == [5, 5], (own_stages, launches)
