"""Attack list cases (see tests/up/attacks/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ATTACKS: list[Callable[[Any], None]] = []
