"""Per-request adapters in transformers' continuous batching (``engine.py``)."""
