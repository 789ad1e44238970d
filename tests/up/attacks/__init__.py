"""The attack list's cases by subject, run by tests/up/test_attack_list.py against one real
`llmgw up`, in the order listed here. Each module holds ``ATTACKS``: functions taking the run
(``tests.up.test_attack_list.Run``: its clients, ``expect``, ``chat_ok``) that send one
finding's hostile requests and assert each answer. A case must leave the demo serving: the
run's last step is an ordinary chat that must succeed, and no listener may answer >= 500 nor
log at error level during the whole run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.up.attacks import admin_input, api_routes, auth, memory, parsing, tokenizing

Attack = Callable[[Any], None]

ATTACKS: list[Attack] = [
    *parsing.ATTACKS,
    *admin_input.ATTACKS,
    *auth.ATTACKS,
    *memory.ATTACKS,
    *tokenizing.ATTACKS,
    *api_routes.ATTACKS,
]
