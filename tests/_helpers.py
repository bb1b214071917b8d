"""Small helpers shared by the test files."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from typing import Iterable

import torch

from peft_fastlora import Tuning
from peft_fastlora.backend.packed import PackedWeights, block_align

TESTS = os.path.dirname(os.path.abspath(__file__))


def count_calls(monkeypatch, owner, names: Iterable[str]) -> Counter:
    """Wrap ``owner.<name>`` (a class or a module) for each name so that every call is counted
    in the returned Counter, then runs the original. ``monkeypatch`` undoes it after the test."""
    counter = Counter()
    for name in names:
        original = getattr(owner, name)

        def counted(*args, _orig=original, _name=name, **kwargs):
            counter[_name] += 1
            return _orig(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return counter


def record_glu_expand_launches(monkeypatch) -> list:
    """The token count of every ``ops.glu_expand`` launch from now on, in order (the launch still
    runs); ``monkeypatch`` undoes the wrap after the test."""
    import peft_fastlora.ops as ops

    tokens, launch = [], ops.glu_expand

    def recorded(y, *args, **kwargs):
        tokens.append(y.shape[0])
        return launch(y, *args, **kwargs)

    monkeypatch.setattr(ops, "glu_expand", recorded)
    return tokens


SITE_KINDS = {3: "qkv", 2: "gate_up", 1: "linear"}  # a packed call's modules -> the site it serves


def count_backend_calls(monkeypatch, owner, names: Iterable[str]) -> Counter:
    """``count_calls`` on the backend's methods ``names`` and on ``run_packed_lora``, whose calls
    are also counted by the kind of site they serve ("qkv", "gate_up", "linear")."""
    counter = count_calls(monkeypatch, owner, [n for n in names if n != "run_packed_lora"])
    original = owner.run_packed_lora

    def counted(self, x, weights, *args, **kwargs):
        counter["run_packed_lora"] += 1
        counter[SITE_KINDS.get(weights.stack_num, "stacked")] += 1
        return original(self, x, weights, *args, **kwargs)

    monkeypatch.setattr(owner, "run_packed_lora", counted)
    return counter


def pack(a, b, offsets, ranks, seed=0) -> PackedWeights:
    """The padded stacks ``a`` (num_slots, c*R, K) and ``b`` (num_slots, N, R) as packed arenas:
    blocks in a shuffled order, a gap of 8 elements after each, NaN everywhere else; aligned to 8
    where every rank is a multiple of 8, as the pool does."""
    c, k = len(offsets) - 1, a.shape[2]
    r_max = b.shape[2]
    blocks = [(s, j) for s in range(a.shape[0]) for j in range(c) if int(ranks[s, j]) > 0]
    random.Random(seed).shuffle(blocks)
    a_rows = torch.zeros(a.shape[0], c, dtype=torch.int32, device=a.device)
    b_offs = torch.zeros(a.shape[0], c, dtype=torch.int64, device=a.device)
    row, off, place = 0, 0, []
    for s, j in blocks:
        rank = int(ranks[s, j])
        width = offsets[j + 1] - offsets[j]
        a_rows[s, j], b_offs[s, j] = row, off
        place.append((s, j, row, off))
        row += rank + 8
        off += width * rank + 8
    arena_a = torch.full((row, k), float("nan"), dtype=a.dtype, device=a.device)
    arena_b = torch.full((off,), float("nan"), dtype=a.dtype, device=a.device)
    w = PackedWeights(arena_a, arena_b, a_rows, b_offs, r_max, tuple(offsets),
                      align=block_align(r for r in ranks.flatten().tolist() if r),
                      mixed_ranks=len({r for r in ranks.flatten().tolist() if r}) > 1)
    for s, j, row, off in place:
        rank = int(ranks[s, j])
        w.a_view(row, rank).copy_(a[s, j * r_max: j * r_max + rank])
        w.b_view(off, j, rank).copy_(b[s, offsets[j]: offsets[j + 1], :rank])
    return w


class TokenStream:
    """A streamer (transformers' ``BaseStreamer`` interface) that keeps each chunk it is given as a
    list of token ids, and "end" when the stream ends: two streams compare with ``==``."""

    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.chunks.append("end")


STAGED_ON_CPU = Tuning(staged_devices=("cuda", "cpu"))


def stage_host_copies(monkeypatch) -> list:
    """Count ``lora.host_copy``'s stagings, the path registered adapters take into slots on CUDA
    (each adapter's buffer in one copy, queued before the pools place it, its views filled from the
    stage), which a model patched with ``tuning=STAGED_ON_CPU`` takes on the CPU too. Returns a list
    that gets an entry per staging: "prestage" where a load's buffers went first, "staged" for
    ``copy_from_host``'s own."""
    from peft_fastlora.lora import host_copy
    import peft_fastlora.lora.slot_loader as loader_module

    staged, stage, prestage = [], host_copy._staged_copy, host_copy.prestage

    def counted_prestage(*a):
        out = prestage(*a)
        if out:
            staged.append("prestage")
        return out

    monkeypatch.setattr(host_copy, "_staged_copy", lambda *a: staged.append("staged") or stage(*a))
    monkeypatch.setattr(loader_module, "prestage", counted_prestage)
    return staged


class DoneEvent:
    """A CPU stand-in for ``torch.Event`` (the deferred stop check's): CPU copies have finished
    when they return."""

    def __init__(self, device=None, blocking=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def run_tp_worker(tmp_path, arch: str, device: str, graphs: str, layout: str = "peft", ops: str = "kernels",
                  nproc: int = 2, heads: str = "", fold: bool = False):
    """torchrun ``_tp_worker.py`` on ``nproc`` ranks; asserts every rank reported ok."""
    env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # PEFT's mixed batch walks a set of adapter names; its order must be the same on
               # every rank (each adapter's rowwise LoRA does a collective)
               PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
               # NVLink multicast stays off in every process, as on the multi-GPU hosts that need it
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               FASTLORA_TEST_FOLD="1" if fold else "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.join(TESTS, "_tp_worker.py"), str(tmp_path / arch), arch, device, graphs, layout, ops, heads]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for rank in range(nproc):
        assert f"rank {rank}: ok" in run.stdout, run.stdout[-3000:]
    return run.stdout
