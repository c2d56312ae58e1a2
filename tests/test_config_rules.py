"""Config's rules, one module per concern under dtrain.config.rules: each concern refuses
its own options by name, the rules across concerns run after them, and the specs share
the rules' flag lists instead of restating them."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from dtrain.config import Config
from dtrain.config import rules as config_rules
from dtrain.errors import ConfigError
from dtrain.strategies.specs import lookup


def refusal(**options: object) -> str:
    with pytest.raises(ConfigError) as info:
        Config(**options)
    return str(info.value)


def test_every_rule_module_is_checked() -> None:
    """A concern added to the package but left out of CONCERNS would never run."""
    checked = {concern.__name__ for concern in config_rules.CONCERNS}
    checked.add(config_rules.cross.__name__)
    with_rules = set()
    for module in pkgutil.iter_modules(config_rules.__path__):
        name = f"{config_rules.__name__}.{module.name}"
        if hasattr(importlib.import_module(name), "check"):
            with_rules.add(name)
    assert with_rules == checked


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"strategy": "hybrid", "nproc": 4, "pp": 0}, "--pp must be at least 1, got 0."),
        ({"strategy": "tensor", "tp": -1}, "--tp must be at least 1, got -1."),
        # a strategy that lays out no model parallelism names the flag before its value
        ({"strategy": "ddp", "nproc": 2, "dp": 0}, "--dp shape model parallelism"),
        ({"strategy": "ddp", "nproc": 2, "servers": 0}, "--servers configure parameter servers"),
        ({"strategy": "ps", "nproc": 2, "servers": 0}, "--strategy ps needs at least one server"),
        ({"strategy": "zero2", "hierarchical": True}, "--hierarchical arranges ddp's gradient"),
        ({"strategy": "zero3", "sync_every": 0}, "--sync-every: options of the syncs"),
        ({"master": "h:1"}, "--master names node 0's rendezvous for a multi-node job"),
        ({"hosts": ["a:1"], "master": "h:1"}, "-H/--hostfile start every machine from this one"),
    ],
)
def test_each_concern_refuses_its_options_by_name(options: dict, message: str) -> None:
    assert message in refusal(**options)


def test_the_rules_across_concerns_run_after_each_concerns_own() -> None:
    # --ps-mode async refuses backup workers before they are weighed against --nproc
    assert "--backup-workers applies to --ps-mode sync" in refusal(
        strategy="ps", ps_mode="async", backup_workers=1
    )
    assert "--backup-workers must lie in [0, --nproc)" in refusal(
        strategy="ps", nproc=2, backup_workers=2
    )
    # an unknown compression is the slow-link concern's; where it compresses, the cross rule's
    assert "Unknown --grad-compression 'zip'" in refusal(strategy="single", grad_compression="zip")
    assert "runs in one process" in refusal(strategy="single", grad_compression="bf16")
    assert "cannot run with --hierarchical" in refusal(
        strategy="ddp", nproc=2, hierarchical=True, grad_compression="powersgd"
    )


def test_a_layout_of_one_stage_refuses_the_pipeline_flags_config_lets_through() -> None:
    """Config accepts the pipeline's flags for tensor; the spec, which knows the degrees,
    names every one of them, in Config's order."""
    config = Config(
        strategy="tensor",
        nproc=2,
        microbatches=4,
        virtual_stages=2,
        schedule="interleaved",
        split_points=["b"],
    )
    given = "--microbatches, --virtual-stages, --split-points, --schedule"
    with pytest.raises(ConfigError, match=f"^{given} shape a pipeline"):
        lookup("tensor").layout(config, 2)


def test_the_public_names_stay_in_dtrain_config() -> None:
    from dtrain.config import COMPRESSES_CAST, MAX_TIMEOUT_S, grad_compression, step_window

    assert grad_compression("powersgd:4") == ("powersgd", 4)
    assert step_window("2:5") == (2, 5)
    assert "hsdp" in COMPRESSES_CAST and MAX_TIMEOUT_S == 7 * 24 * 3600
