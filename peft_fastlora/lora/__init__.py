"""The LoRA side: sites (thin forwards on PEFT's LoRA layers), fusion (q/k/v and gate/up as one
base GEMM) and the pool (adapter stacks, slots, values kept current)."""
