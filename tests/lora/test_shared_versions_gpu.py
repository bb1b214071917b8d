"""One version counter per adapter on the GPU: re-homing parameters on a stream other than the
one they were made on."""

import pytest
import torch
from torch import nn

from peft_fastlora.compat.modules import share_version_counter

pytestmark = pytest.mark.gpu


def _params(seed: int):
    torch.manual_seed(seed)
    a, b = nn.Linear(5, 3), nn.Linear(3, 7, bias=False)
    return [a.weight, a.bias, b.weight]


def test_rehoming_on_a_side_stream_keeps_the_values_while_the_old_storage_is_reused():
    """Re-homed on a stream other than the one the parameters were made on (an engine step's), the
    copies out of the old storages may still be queued when those storages are freed: the
    allocator must not hand them to the next allocation of their own stream before the copies ran."""
    with torch.device("cuda"):
        params = _params(seed=5)
    values = [p.detach().clone() for p in params]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(10 ** 8)  # the copies wait behind this
        assert share_version_counter(params) is not None
    for p in values:  # the old storages' sizes, on their own stream, written at once
        torch.full_like(p, float("nan"))
    torch.cuda.synchronize()
    assert all(torch.equal(p, v) for p, v in zip(params, values))
