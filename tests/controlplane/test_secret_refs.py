"""One check of a secret reference's syntax for both ends: what the admin API refuses before
it stores a profile is what the agent refuses before it resolves one, in the same words,
and neither echoes what may be the secret itself."""

from __future__ import annotations

import pytest

from llmgw.controlplane.profile_checks import check_profile
from llmgw.errors import SpecError
from llmgw.nodeagent.secrets import resolve_secret_refs

_PROFILE = {
    "engine": "sim", "gpu_class": "", "tp": 1, "pp": 1, "gpus_per_node": 0, "nodes": 1,
    "model_path": "/m", "served_model_name": "", "args": [], "env": {}, "adapters": [],
    "kv_events": False, "threads": 0, "kv_hash_seed": "1", "kv_block_size": 16,
    "kv_hash_algo": "sha256_cbor", "kv_extra_key_format": "tagged", "multinode_backend": "ray",
}  # fmt: skip


def _control_plane(ref: str) -> SpecError:
    with pytest.raises(SpecError) as e:
        check_profile("p", {**_PROFILE, "secret_env": {"HF_TOKEN": ref}}, model="m")
    return e.value


def _agent(ref: str) -> SpecError:
    with pytest.raises(SpecError) as e:
        resolve_secret_refs({"HF_TOKEN": ref}, {})
    return e.value


@pytest.mark.parametrize(
    ("ref", "rule"),
    [
        ("hf_s3cr3tValue1234", "value is not a reference; use env:NAME or file:/path"),
        ("", "value is not a reference"),
        ("vault:hf", "value is not a reference"),
        ("env:", "names no variable"),
        ("env:$HF_TOKEN", "letters, digits and _"),
        ("env:HF TOKEN", "letters, digits and _"),
        ("file:secrets/tok", "absolute path"),
        ("file:", "absolute path"),
    ],
)
def test_both_ends_refuse_a_bad_reference_in_the_same_words(ref: str, rule: str) -> None:
    cp, agent = _control_plane(ref), _agent(ref)
    assert rule in cp.message and cp.message == agent.message
    # The admin API names the field of its body, the agent the field of the shard's spec.
    assert (cp.field, agent.field) == ("secret_env.HF_TOKEN", "profile.secret_env.HF_TOKEN")
    if len(ref) > len("file:"):  # never echoed: it may be the secret itself
        assert ref not in cp.message
