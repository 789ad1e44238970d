"""Rows for a bulk statement, sent as one JSONB parameter.

A statement that writes many rows takes them as one parameter that SQL expands with
``jsonb_to_recordset``, the types spelled out there: one statement and one round trip however
many rows. This module only encodes; each statement lives in its subject's module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["jsonb_rows"]


def jsonb_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` as the JSON text a ``CAST(:rows AS jsonb)`` parameter takes."""
    return json.dumps(rows, separators=(",", ":"))
