"""Packed LoRA operands for the GEMMs' LoRA epilogue (``ops.lora_epilogue``), built the way
``lora.pool`` lays them out, shared by the CPU and GPU tests."""

import torch

from peft_fastlora.batch import max_chunks_for, plan_chunks
from peft_fastlora.ops.lora_epilogue import LoraEpilogue


def make_lora(m, widths, ranks, dtype, *, device="cpu", token_slots=None, max_rank=None, block_m=16,
              seed=0, slack_rows=8):
    """A ``LoraEpilogue`` for ``m`` rows over modules of ``widths`` columns: ``ranks[s][j]`` is slot
    s's rank on module j (0: not targeted). Every (slot, module) has its own A rows in the arena
    (columns of ``y``, with ``slack_rows`` more rows no slot owns, all random: a slot that read past
    its rank would pick up another's) and a packed B block whose padding past the rank is random too.
    ``token_slots``: each row's slot (-1: none); random over the slots and -1 by default."""
    g = torch.Generator().manual_seed(seed)
    n_slots, c = len(ranks), len(widths)
    align = 8 if all(r % 8 == 0 for row in ranks for r in row) else 1
    y_cols = torch.zeros(n_slots, c, dtype=torch.int32)
    b_offs = torch.zeros(n_slots, c, dtype=torch.int64)
    rows = elems = 0
    for s in range(n_slots):
        for j in range(c):
            r = ranks[s][j]
            if r <= 0:
                continue
            y_cols[s, j] = rows
            rows += r
            b_offs[s, j] = elems
            elems += widths[j] * (-(-r // align) * align)
    y = torch.randn(m, rows + slack_rows, generator=g).to(dtype)
    b = (torch.randn(max(elems, 8), generator=g) / 4).to(dtype)
    if token_slots is None:
        token_slots = (torch.randint(-1, n_slots, (m,), generator=g)).tolist()
    token_slot, _, chunk_slot, _, _, _ = plan_chunks(token_slots, [1] * m, block_m)
    chunks = max_chunks_for(m, block_m, max(1, n_slots))
    chunk_slot = chunk_slot + [-1] * (chunks - len(chunk_slot))
    tables = dict(ranks=torch.tensor(ranks, dtype=torch.int32).reshape(n_slots, c),
                  scalings=(torch.rand(n_slots, c, generator=g) + 0.5).float())
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    lora = LoraEpilogue(y=y, b=b, b_offs=b_offs, y_cols=y_cols, token_slot=torch.tensor(token_slot, dtype=torch.int32),
                        chunk_slot=torch.tensor(chunk_slot, dtype=torch.int32), offsets=tuple(offsets),
                        max_rank=max_rank or max(max(row) for row in ranks), align=align, **tables)
    return lora._replace(**{k: v.to(device) for k, v in lora._asdict().items() if isinstance(v, torch.Tensor)})
