"""One name rule for every object and node (hardening-3 finding 10): a newline or an
escape sequence in a node's name made it unreachable through the admin API and painted
fake rows into `llmgw status`. The rule, the registration that enforces it, and the agent's
settings that refuse a bad name at start."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from llmgw.config.loading import load_settings
from llmgw.errors import ConfigError
from llmgw.nodeagent.agent_validation import host_node_name
from llmgw.protocol import NodeInventory, RegisterRequest
from llmgw.protocol.names import (
    KEY_NAME_PATTERN,
    NAME_PATTERN,
    key_name_problem,
    name_problem,
    segment_problem,
)
from llmgw.store import tables

HOSTILE = [
    "a\nb",
    "node\n",  # Python's `$` would match before this newline; fullmatch does not
    "\x1b]0;evil\x07",
    "gpu-\x1b[31mred",
    "a b",
    "a\tb",
    "a\rb",
    "-leading-dash",
    ".hidden",
    "x" * 129,
    "a/../b",
    "a//b",
    "trailing/",
    "",
    "naïve",
]
GOOD = ["gpu-node-01", "node.example.com", "org/model-v1", "a:b", "A_1", "x" * 128, "0"]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_are_refused_with_the_rule(name: str) -> None:
    problem = name_problem(name)
    assert problem is not None
    if name and "/" not in name:
        # The name is quoted escaped (never raw control characters) and the rule is given.
        assert repr(name)[:40] in problem and "letters, digits and" in problem
        assert "\n" not in problem and "\x1b" not in problem


@pytest.mark.parametrize("name", GOOD)
def test_ordinary_names_pass(name: str) -> None:
    assert name_problem(name) is None


def test_one_definition_everywhere() -> None:
    # The database's CHECK constraints and the admin API use the same patterns.
    assert tables.NAME_PATTERN is NAME_PATTERN and tables.KEY_NAME_PATTERN is KEY_NAME_PATTERN
    assert key_name_problem("team@tenant") is None
    assert key_name_problem("a/b") is not None and key_name_problem("a\nb") is not None
    assert segment_problem("a/./b") is not None and segment_problem("a/b") is None


def _register(name: str) -> RegisterRequest:
    return RegisterRequest(
        bootstrap_token="t",
        node_name=name,
        mgmt_addr="127.0.0.1",
        inventory=NodeInventory(),
    )


@pytest.mark.parametrize("name", ["a\nb", "\x1b]0;evil\x07", "node\n", "x" * 200])
def test_registration_refuses_a_bad_node_name(name: str) -> None:
    with pytest.raises(ValidationError) as info:
        _register(name)
    (err,) = info.value.errors()
    assert err["loc"] == ("node_name",)
    assert "LLMGW_AGENT__NODE_NAME" in err["msg"]


def test_registration_takes_a_good_node_name() -> None:
    assert _register("gpu-node-01.example.com").node_name == "gpu-node-01.example.com"


def test_the_agent_refuses_a_bad_node_name_at_start() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(agent={"node_name": "bad\nname"})
    assert info.value.field == "agent.node_name"
    assert "not a valid name" in info.value.message and "LLMGW_AGENT__NODE_NAME" in str(info.value)
    assert load_settings(agent={"node_name": "gpu-01"}).agent.node_name == "gpu-01"
    assert load_settings().agent.node_name == ""  # empty: the host name, checked by the agent


def test_a_host_name_the_rule_refuses_is_a_start_error_naming_the_setting() -> None:
    assert host_node_name("gpu-01.example.com") == "gpu-01.example.com"
    with pytest.raises(ConfigError) as info:
        host_node_name("h" * 200)
    assert info.value.field == "agent.node_name"
    assert "set agent.node_name" in info.value.message
