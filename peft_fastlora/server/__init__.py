"""An OpenAI-compatible HTTP endpoint over the continuous-batching manager (``app.py``)."""

from .app import create_app
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
