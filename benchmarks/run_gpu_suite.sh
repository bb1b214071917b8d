#!/usr/bin/env bash
# Everything that needs the GPU, in one call of the device machine: GPU tests, kernel benchmark,
# end-to-end benchmark. Results land in $OUT (and are committed under benchmarks/results/).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
part=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
if [[ $part == all || $part == tests ]]; then
  files=$(ls tests/*_gpu.py)
  timeout 360 python3 -m pytest -m gpu -q -p no:cacheprovider $files 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  timeout 120 python3 examples/quickstart.py 2>&1 | tee "$OUT/quickstart_gpu.log" | tail -12
fi
if [[ $part == all || $part == kernels ]]; then
  timeout 240 python3 benchmarks/bench_kernels.py --out "$OUT/kernels_h200.csv" 2>&1 | tee "$OUT/bench_kernels.log" | tail -40
fi
if [[ $part == all || $part == generate ]]; then
  timeout 420 python3 benchmarks/bench_generate.py --models ${MODELS:-1b 8b} --out "$OUT" 2>&1 | tee "$OUT/bench_generate.log" | grep -v -i warn | tail -45
fi
if [[ $part == all || $part == profile ]]; then
  timeout 150 python3 benchmarks/profile_step.py --model 8b --batch 32 --out "$OUT/profile_step_h200.csv" 2>&1 | grep -v -i warn | tail -40
fi
if [[ $part == all || $part == attention ]]; then
  timeout 200 python3 benchmarks/bench_attention.py --out "$OUT/attention_h200.csv" 2>&1 | tee "$OUT/bench_attention.log" | tail -30
fi
