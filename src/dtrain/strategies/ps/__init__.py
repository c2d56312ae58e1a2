"""The parameter-server strategy (`--strategy ps`): servers, worker client, sharding, protocol."""

from dtrain.strategies.ps.protocol import ParameterServerError
from dtrain.strategies.ps.strategy import ParameterServer

__all__ = ["ParameterServer", "ParameterServerError"]
