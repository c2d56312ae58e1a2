"""A run's options: :class:`Config` (options.py), the rules a Config keeps (rules/, one
module per concern), and ``--config FILE.toml`` (file.py). `dtrain.config.Config` is public.

A foundation: it imports only the leaves, and no torch.
"""

from dtrain.config.options import ENV_VAR, Config
from dtrain.config.rules.artifacts import step_window
from dtrain.config.rules.launching import MAX_TIMEOUT_S
from dtrain.config.rules.slow_links import (
    COMPRESSES_CAST,
    COMPRESSES_POWERSGD,
    grad_compression,
    training_of,
)

__all__ = [
    "COMPRESSES_CAST",
    "COMPRESSES_POWERSGD",
    "ENV_VAR",
    "MAX_TIMEOUT_S",
    "Config",
    "grad_compression",
    "step_window",
    "training_of",
]
