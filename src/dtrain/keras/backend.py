"""Keras 3 on its torch backend: import it with a message that says how to install it, and
refuse any other backend before a model is wrapped.

Importing this module before Keras selects the torch backend (``KERAS_BACKEND=torch``)
unless ``KERAS_BACKEND`` already names one: Keras reads the variable once, at its own
import, and dtrain.keras only works on torch, so choosing it here saves the user a
restart.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from dtrain.errors import ConfigError

INSTALL = "pip install 'dtrain[keras]'"
"""The command that installs the Keras extra."""


def import_keras() -> ModuleType:
    """Keras 3, imported on the torch backend unless the environment chose another.

    Raises ImportError naming the install command when Keras is missing or older than 3,
    and naming the torch backend when Keras cannot load the backend chosen instead.
    """
    if "keras" not in sys.modules:
        os.environ.setdefault("KERAS_BACKEND", "torch")
    try:
        import keras
    except ImportError as error:
        if error.name == "keras":
            raise ImportError(
                f"dtrain.keras needs Keras 3, which is not installed; install it with "
                f"{INSTALL}, then run again with KERAS_BACKEND=torch."
            ) from error
        # Keras is there but could not load the backend KERAS_BACKEND names.
        raise ImportError(
            f"Keras could not load its {os.environ.get('KERAS_BACKEND')!r} backend "
            f"({error}); dtrain.keras runs Keras on PyTorch: set KERAS_BACKEND=torch in the "
            "environment and run again."
        ) from error
    major = int(keras.__version__.split(".")[0])
    if major < 3:
        raise ImportError(
            f"dtrain.keras needs Keras 3, but Keras {keras.__version__} is installed; "
            f"upgrade it with {INSTALL} (Keras 3 runs on PyTorch, Keras 2 does not)."
        )
    return keras


keras = import_keras()


def require_torch_backend() -> None:
    """Raise ConfigError unless Keras runs on its torch backend."""
    name = keras.backend.backend()
    if name != "torch":
        raise ConfigError(
            f"dtrain.keras trains Keras models as PyTorch modules, but Keras runs on its "
            f"{name!r} backend. Set KERAS_BACKEND=torch in the environment before Python "
            "starts (or before the first `import keras`), then run again."
        )
