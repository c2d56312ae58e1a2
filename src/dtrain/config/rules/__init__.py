"""The rules a :class:`dtrain.config.Config` must keep, one module per concern.

Each concern checks only its own options (and whether the strategy reads them):
`launching` the processes, machines and rendezvous; `computation` each step's
arithmetic; `artifacts` what the run writes; `slow_links` --hierarchical, gradient
compression and local SGD; `parallelism` the mesh layouts; `parameter_servers` ps.
`cross` holds the rules between concerns, `choices` the refusals they share. The rules
here need no machine and no model; those that need the number of processes of a launch
or the model live in the strategy's spec or runtime. Importable without torch, like
Config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.config.rules import (
    artifacts,
    computation,
    cross,
    launching,
    parallelism,
    parameter_servers,
    slow_links,
)

if TYPE_CHECKING:
    from dtrain.config import Config

CONCERNS = (launching, computation, artifacts, slow_links, parallelism, parameter_servers)
"""The concerns in the order they are checked: the first rule broken is the one reported."""


def check(config: Config) -> None:
    """Raise the ConfigError of the first rule `config` breaks: each concern's own rules
    in order, then the rules across concerns."""
    for concern in CONCERNS:
        concern.check(config)
    cross.check(config)
