"""Decode inside HF ``generate``: the generate hook (call boundaries, warm-up), the CUDA-graph
runner, its static KV caches, and capture that leaves the process healthy when it fails."""
