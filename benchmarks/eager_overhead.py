"""Eager (no graphs) decode step of the patched 1B model with and without the one-kernel small ops,
and the top Python functions of one eager generate call (where the host time goes)."""

import cProfile
import io
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_generate as bg  # noqa: E402
import peft_fastlora as fastlora  # noqa: E402

model = bg.add_adapters(bg.build_base("1b"), 8, 16)
b = 32
ids = torch.randint(3, 1000, (b, 128), device="cuda")
names = [f"a{i % 8}" for i in range(b)]
kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, adapter_names=names)


def step_ms():
    gen = lambda n: model.generate(**kw, max_new_tokens=n, min_new_tokens=n)  # noqa: E731
    _, ms, _ = bg.measure(gen, 17, 3)
    return ms


for opts in (dict(), dict(fuse_rotary=False, fuse_silu_mul=False), dict(fuse_rotary=False, fuse_silu_mul=False,
             fuse_norms=False, decode_attention=False)):
    fastlora.patch(model, cuda_graphs=False, **opts)
    print(opts or "all small ops", f"{step_ms():.2f} ms/step", flush=True)
    fastlora.unpatch(model)
fastlora.patch(model, cuda_graphs=False)
prof = cProfile.Profile()
prof.enable()
model.generate(**kw, max_new_tokens=9, min_new_tokens=9)
torch.cuda.synchronize()
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue()[:6000])
