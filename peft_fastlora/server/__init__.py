"""An OpenAI-compatible HTTP endpoint over the continuous-batching manager (``app.py``)."""

from .app import create_app

__all__ = ["create_app"]
