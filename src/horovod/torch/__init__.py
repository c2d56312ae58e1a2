"""``horovod.torch``: dtrain's Horovod PyTorch API (`dtrain.horovod`) under Horovod's name.

The submodules scripts import by name (``horovod.torch.compression``, ``.functions``,
``.optimizer``, ``.mpi_ops``) are the matching dtrain modules.
"""

from __future__ import annotations

import sys

from dtrain import horovod as _impl
from dtrain.horovod import *  # noqa: F403 - the alias re-exports the whole API
from dtrain.horovod import __all__ as __all__  # noqa: F401
from dtrain.horovod import compression, elastic, functions, optimizer

for _name, _module in {
    "compression": compression,
    "elastic": elastic,
    "functions": functions,
    "optimizer": optimizer,
    "mpi_ops": _impl,
}.items():
    sys.modules[f"{__name__}.{_name}"] = _module
