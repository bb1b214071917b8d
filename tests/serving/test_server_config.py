"""``ServerConfig`` refuses bad settings when it is built, naming the field (CPU, no server)."""

from __future__ import annotations

import pytest

from peft_fastlora.server.config import ServerConfig


@pytest.mark.parametrize("field, value, message", [
    ("base_name", "", "base_name must be a non-empty string"),
    ("max_pending", 0, "max_pending must be a positive integer"),
    ("max_tokens_default", True, "max_tokens_default must be a positive integer"),
    ("max_model_len", 1, "max_model_len must be an integer of at least 2"),
    ("restart_attempts", -1, "restart_attempts must be a non-negative integer"),
    ("restart_wait_s", -0.5, "restart_wait_s must be a non-negative number"),
    ("api_key", "", "api_key must be a non-empty string"),
    ("adapter_root", 3, "adapter_root must be a folder path"),
    ("warmup", "yes", "warmup must be True or False"),
    ("warmup", 1, "warmup must be True or False"),
])
def test_bad_settings_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(**{field: value})
    with pytest.raises(ValueError, match=message):
        ServerConfig().replace(**{field: value})


def test_defaults_warm_the_engine_up():
    assert ServerConfig().warmup is True and ServerConfig(warmup=False).warmup is False
