"""Node inventories as placement reads them, remembered by their stored text from one
reconcile pass to the next (``read.py``'s node statement).

An agent reports the same inventory sync after sync, yet each pass parsed every node's JSON
and judged it again (``intake.placeable``): at 10,000 nodes × 8 GPUs, ~40% of the snapshot
load (bench/reconcile.py). Both are pure functions of the text, so a pass fetches the text
and looks it up; an inventory that changed, or was never seen, is parsed as before. Postgres
writes jsonb as text in one canonical form, so the same document is the same text.

The rules stay ``intake``'s: this only remembers what they gave.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.planner import intake
from llmgw.planner.intake import Device

__all__ = ["InventoryMemo", "Placeable"]


@dataclass(frozen=True, slots=True)
class Placeable:
    """What placement may use of one inventory, and the device -> placement index map."""

    inventory: intake.Inventory
    placement_index: Mapping[Device, int]

    @classmethod
    def of(cls, inventory: Mapping[str, object]) -> Placeable:
        placeable = intake.placeable(inventory)
        return cls(placeable, placeable.placement_index())


class InventoryMemo:
    """``Placeable`` by inventory text, kept from one pass to the next.

    It holds what the last pass looked up and nothing else (each pass's lookups become the
    next pass's memo): bounded by the fleet, and a node gone is forgotten a pass later. Keyed
    by content, one memo may serve several reconcilers (a test's control planes): a miss
    costs a parse, never a wrong answer. The values are shared by passes and read only, as
    the frozen views holding them are.
    """

    def __init__(self) -> None:
        self._last: dict[str, Placeable] = {}
        self._this: dict[str, Placeable] = {}

    def placeable(self, text: str) -> Placeable:
        found = self._this.get(text) or self._last.get(text)
        if found is None:
            found = Placeable.of(json.loads(text))
        self._this[text] = found
        return found

    def end_pass(self) -> None:
        """The lookups since the last call become the memo; the rest is forgotten."""
        self._last, self._this = self._this, {}

    def clear(self) -> None:
        """Forget everything: the next pass parses every inventory, as a new leader's first
        does (bench/reconcile.py measures that)."""
        self._last, self._this = {}, {}
