"""The runtime strategy stays small: the step protocol (`Strategy`), the state checkpoints
read (`CheckpointState`) and where the work runs (`Placement`) each keep under 16 public
members, and no strategy restates a layout fact as an attribute of its own."""

from __future__ import annotations

from dataclasses import fields

from dtrain.strategies.base import Strategy
from dtrain.strategies.checkpoint_state import CheckpointState
from dtrain.strategies.placement import Placement
from dtrain.strategies.specs import available, lookup

MOST_MEMBERS = 15


def _own_public(cls: type) -> set[str]:
    """The public methods and properties `cls` defines itself (not those it inherits)."""
    return {name for name in vars(cls) if not name.startswith("_")}


def test_each_part_of_the_runtime_strategy_has_at_most_15_members():
    parts = {
        "Strategy": _own_public(Strategy),
        "CheckpointState": _own_public(CheckpointState),
        "Placement": _own_public(Placement) | {f.name for f in fields(Placement)},
    }
    too_big = {name: sorted(m) for name, m in parts.items() if len(m) > MOST_MEMBERS}
    assert not too_big, (
        f"Over {MOST_MEMBERS} public members: {too_big}; group some into a part of their own."
    )


def test_strategies_give_layout_facts_through_their_placement_only():
    """A property named like a Placement field would be read by no one (the Engine,
    evaluation and checkpoints read `strategy.placement`): a strategy's `__init__`
    replaces the placement's fields instead."""
    facts = {f.name for f in fields(Placement)}
    runtimes = {lookup(name).runtime() for name in available()}
    restated = {
        cls.__name__: sorted(facts & set(vars(cls)))
        for runtime in runtimes
        for cls in runtime.__mro__
        if facts & set(vars(cls))
    }
    assert not restated, f"Layout facts restated outside strategy.placement: {restated}"
