"""An alias that lets Horovod scripts run on dtrain unchanged: ``import horovod.torch as
hvd`` gives `dtrain.horovod`. It is not Horovod; if the real Horovod is installed too,
whichever comes first on sys.path is imported (uninstall the real one to be sure).

`__version__` names the Horovod release whose PyTorch API this follows, for scripts that
check it.
"""

from __future__ import annotations

__version__ = "0.28.1"
