"""Models, served names and adapters share one namespace (hardening-3 finding 14): the pure
checks the admin API and apply run before anything is stored."""

from __future__ import annotations

from llmgw.controlplane.admin.namespace import (
    NamedProfile,
    Namespace,
    batch_clashes,
    model_clash,
    profile_clash,
)

BASE = NamedProfile("base-sim", "base", "base", ("sql", "chat"))


def _p(name: str, model: str, *adapters: str, served: str = "") -> NamedProfile:
    return NamedProfile(name, model, served or model, adapters)


def test_a_model_named_like_an_adapter_clashes() -> None:
    clash = model_clash("sql", [BASE])
    assert clash is not None and clash.field == "name"
    assert clash.message.startswith("model name 'sql' is taken by an adapter of profile 'base-sim'")
    assert "share one namespace" in clash.message and "another name" in clash.message
    assert clash.error().status == 409
    assert model_clash("other", [BASE]) is None


def test_an_adapter_named_like_a_model_clashes() -> None:
    clash = profile_clash(_p("p", "m", "ok", "base"), {"m", "base"}, [BASE])
    assert clash is not None and clash.field == "adapters.1.name"
    assert "adapter name 'base' is taken by model 'base'" in clash.message


def test_other_clashes_of_adapters_and_served_names() -> None:
    models = {"m", "base"}
    # Another model's profile has the adapter already.
    got = profile_clash(_p("p", "m", "sql"), models, [BASE])
    assert got is not None and "an adapter of profile 'base-sim' (model 'base')" in got.message
    # The same adapter on two profiles of one model is one route: allowed.
    assert profile_clash(_p("base-gpu", "base", "sql"), models, [BASE]) is None
    # Named like another profile's served name, or its own.
    got = profile_clash(_p("p", "m", "srv"), models, [_p("q", "base", served="srv")])
    assert got is not None and "the served name of profile 'q'" in got.message
    got = profile_clash(_p("p", "m", "x", served="x"), models, [])
    assert got is not None and "this profile's own served name" in got.message
    # Twice in one profile.
    got = profile_clash(_p("p", "m", "x", "x"), models, [])
    assert got is not None and got.field == "adapters.1.name"
    # A served name that is another model's adapter.
    got = profile_clash(_p("p", "m", served="chat"), models, [BASE])
    assert got is not None and got.field == "served_model_name"


def test_a_batch_is_checked_as_it_would_be_once_applied() -> None:
    stored = Namespace(models={"base"}, profiles=[BASE])
    # A new model named like a stored adapter; a new profile's adapter named like a model of
    # the same batch.
    got = batch_clashes(stored, [(0, "sql"), (1, "new")], [(2, _p("p", "other", "new"))])
    # Both sides of a clash inside the batch are named.
    assert [(i, c.field) for i, c in got] == [(0, "name"), (1, "name"), (2, "adapters.0.name")]
    # Redefining the stored profile without the adapter frees its name in the same batch.
    freed = batch_clashes(stored, [(0, "sql")], [(1, _p("base-sim", "base", "chat"))])
    assert freed == []
