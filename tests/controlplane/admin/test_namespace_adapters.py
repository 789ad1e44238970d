"""Declared adapters (`kind: adapter`) in the one namespace of the names clients send as
`model`: the pure checks the admin routes and apply run, both ways (an adapter document may
not take a model's, a served or a static adapter's name; none of those may take its)."""

from __future__ import annotations

from llmgw.controlplane.admin.namespace import (
    NamedProfile,
    Namespace,
    adapter_clash,
    batch_clashes,
    model_clash,
    profile_clash,
)

BASE = NamedProfile("base-sim", "base", "base-served", ("sql",))
DECLARED = {"chat": "base"}


def _p(name: str, model: str, *adapters: str, served: str = "") -> NamedProfile:
    return NamedProfile(name, model, served or model, adapters)


def test_an_adapter_document_may_not_take_a_name_already_held() -> None:
    models = {"base", "other"}
    got = adapter_clash("other", models, [BASE])
    assert got is not None and got.field == "name"
    assert got.message.startswith("adapter name 'other' is taken by model 'other': ")
    assert got.message.endswith("give the adapter another name, or delete the model")
    got = adapter_clash("base-served", models, [BASE])
    assert got is not None
    assert "the served name of profile 'base-sim' (model 'base')" in got.message
    assert "served_model_name" in got.message
    # A static adapter of any model's profile: two routes of one name, the gateway keeps one.
    got = adapter_clash("sql", models, [BASE])
    assert got is not None and "a static adapter of profile 'base-sim'" in got.message
    assert got.error().status == 409
    assert adapter_clash("fresh", models, [BASE]) is None


def test_models_and_profiles_may_not_take_an_adapter_documents_name() -> None:
    got = model_clash("chat", [BASE], DECLARED)
    assert got is not None and got.field == "name"
    assert "taken by adapter 'chat' (declared with `kind: adapter` on model 'base')" in got.message
    assert "DELETE /admin/v1/adapters/chat" in got.message
    # Without the declared adapters, the old rule alone.
    assert model_clash("chat", [BASE]) is None
    got = profile_clash(_p("p", "m", "ok", "chat"), {"m", "base"}, [BASE], DECLARED)
    assert got is not None and got.field == "adapters.1.name"
    assert "declared with `kind: adapter`" in got.message
    got = profile_clash(_p("p", "m", served="chat"), {"m", "base"}, [BASE], DECLARED)
    assert got is not None and got.field == "served_model_name"
    assert profile_clash(_p("p", "m", "ok"), {"m", "base"}, [BASE], DECLARED) is None


def test_a_batch_with_adapter_documents_is_checked_as_it_would_be_once_applied() -> None:
    stored = Namespace(models={"base"}, profiles=[BASE], adapters=dict(DECLARED))
    got = batch_clashes(
        stored,
        [(0, "chat"), (1, "twin")],
        [(2, _p("p", "base", "new-static"))],
        [(3, "twin", "base"), (4, "new-static", "base"), (5, "fine", "base")],
    )
    assert sorted((i, c.field) for i, c in got) == [
        (0, "name"),  # a model named like a stored adapter document
        (1, "name"),  # a model and an adapter document of the batch: both named
        (2, "adapters.0.name"),  # a static adapter named like a document of the batch
        (3, "name"),
        (4, "name"),
    ]
    # Redefining the stored profile without its static adapter frees that name for a document.
    assert batch_clashes(stored, [], [(0, _p("base-sim", "base"))], [(1, "sql", "base")]) == []
    # Re-declaring a stored adapter document is the same object, not a clash.
    assert batch_clashes(stored, [], [], [(0, "chat", "base")]) == []
