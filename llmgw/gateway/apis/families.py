"""The API families the public listener serves, and which one a request's method and path ask
for (issue #38).

A family is one API a client speaks: OpenAI's chat completions, completions, Responses and
pooling routes (embeddings, rerank, score), Anthropic's Messages and its token counter. Each
says what the request path does with it:

- ``api``: its name, and the ``api`` label of every ``llmgw_gateway_*`` series it counts in;
- ``generates``: True for a family whose create generates tokens: routed by prefix (its
  prompt scored against the KV index, like chat), flow-controlled, its output reserved from
  the key's limits. False: load-balanced across the model's replicas only (an embedding, a
  rerank or a token count leaves no cache worth routing to and generates nothing);
- ``group``: the API group a profile must serve for the model to answer it: ``generate``
  (a model run by vLLM's default runner) or ``pooling`` (``--runner pooling``); a model that
  does not serve the group answers 404 naming the routes it does serve (``routes_of``);
- ``errors``: the shape its errors take, OpenAI's or Anthropic's (``anthropic_errors``), so a
  client's own SDK raises its own exception classes, whatever failed;
- ``x_api_key``: the key may come as ``x-api-key`` (Anthropic's SDK sends it there), besides
  ``Authorization: Bearer``.

Responses add two routes on a stored response (``GET /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel``): the ``{id}`` is the gateway's wrapped id (``response_ids``),
handed back as ``Match.response_id`` for the shell to unwrap; such a request goes to the replica
the id names, never routed (``Match.generates`` is False for it).

Cost: the gateway's hot path is benchmarked (bench/gateway.py), so an exact path costs one dict
probe and one more for its method, returning a ``Match`` built once at import: no allocation,
as cheap as today's string compares. Only ``/v1/responses/...`` paths are parsed, and only for
the two routes that carry an id.

What it must NOT do: echo a path or method whole (a message quotes them through ``clip``), or
decide anything about a body (``prompts`` reads bodies).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from llmgw.errors import clip

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "EMBEDDINGS",
    "FAMILIES",
    "MESSAGES",
    "RERANK",
    "RESPONSES",
    "SCORE",
    "ApiName",
    "ErrorShape",
    "Family",
    "Group",
    "Match",
    "Miss",
    "Operation",
    "Route",
    "credential",
    "engine_path",
    "match",
    "public_routes",
    "routes_of",
]

ApiName = Literal[
    "chat", "completions", "responses", "messages", "count_tokens", "embeddings", "rerank", "score"
]
Group = Literal["generate", "pooling"]
ErrorShape = Literal["openai", "anthropic"]
# create: the family's request proper; retrieve and cancel: a stored response, by its id.
Operation = Literal["create", "retrieve", "cancel"]

# The id segment of a Responses path ("{id}"), as the documents name it.
_ID = "{id}"


@dataclass(frozen=True, slots=True)
class Route:
    method: str  # the one method it answers (HEAD is not a GET here: nothing to send for it)
    path: str  # as documented: "/v1/responses/{id}" names the id segment
    operation: Operation

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(frozen=True, slots=True)
class Family:
    api: ApiName  # its name and the `api` label of its metrics
    routes: tuple[Route, ...]
    generates: bool  # prefix-routed, flow-controlled, output reserved; False: balanced only
    group: Group  # what a profile must serve for its model to answer this family
    errors: ErrorShape
    x_api_key: bool = False  # the key may come as `x-api-key` (Anthropic's clients)


def _post(path: str) -> tuple[Route, ...]:
    return (Route("POST", path, "create"),)


CHAT: Final = Family("chat", _post("/v1/chat/completions"), True, "generate", "openai")
COMPLETIONS: Final = Family("completions", _post("/v1/completions"), True, "generate", "openai")
RESPONSES: Final = Family(
    "responses",
    (
        Route("POST", "/v1/responses", "create"),
        Route("GET", "/v1/responses/{id}", "retrieve"),
        Route("POST", "/v1/responses/{id}/cancel", "cancel"),
    ),
    True,
    "generate",
    "openai",
)
MESSAGES: Final = Family(
    "messages", _post("/v1/messages"), True, "generate", "anthropic", x_api_key=True
)
# Counting renders the prompt and tokenizes it, nothing more: a generating model's route (it
# needs the chat template), but not worth a prefix score or a place in the model's queue.
COUNT_TOKENS: Final = Family(
    "count_tokens",
    _post("/v1/messages/count_tokens"),
    False,
    "generate",
    "anthropic",
    x_api_key=True,
)
EMBEDDINGS: Final = Family("embeddings", _post("/v1/embeddings"), False, "pooling", "openai")
RERANK: Final = Family("rerank", _post("/v1/rerank"), False, "pooling", "openai")
SCORE: Final = Family("score", _post("/v1/score"), False, "pooling", "openai")

FAMILIES: Final[tuple[Family, ...]] = (
    CHAT,
    COMPLETIONS,
    RESPONSES,
    MESSAGES,
    COUNT_TOKENS,
    EMBEDDINGS,
    RERANK,
    SCORE,
)


@dataclass(frozen=True, slots=True)
class Match:
    family: Family
    route: Route
    # The path's {id} as the client sent it (a wrapped id: ``response_ids.unwrap`` reads it);
    # None on a route without one.
    response_id: str | None = None

    @property
    def generates(self) -> bool:
        """Routed by prefix and flow-controlled: a generating family's create. A stored
        response's retrieve or cancel goes where its id says, and generates nothing."""
        return self.family.generates and self.route.operation == "create"


@dataclass(frozen=True, slots=True)
class Miss:
    """Why no family answers: a 404 (no such path) or a 405 (the path, another method)."""

    status: Literal[404, 405]
    code: Literal["unknown_url", "method_not_allowed"]
    message: str
    allow: str  # 405: the Allow header's value; "" for a 404
    # 405: the family whose path it is, so the answer takes its error shape; None for a 404.
    family: Family | None = None


# Paths the listener answers outside the families, listed in a 404's message.
_OTHER_ROUTES: Final = ("GET /v1/models",)
_RESPONSES_PREFIX: Final = "/v1/responses/"
_CANCEL_SUFFIX: Final = "/cancel"


def _exact_table() -> dict[str, dict[str, Match]]:
    table: dict[str, dict[str, Match]] = {}
    for family in FAMILIES:
        for route in family.routes:
            if _ID not in route.path:
                table.setdefault(route.path, {})[route.method] = Match(family, route)
    return table


_EXACT: Final[Mapping[str, Mapping[str, Match]]] = _exact_table()
_RETRIEVE: Final = RESPONSES.routes[1]
_CANCEL: Final = RESPONSES.routes[2]
_ALL_ROUTES: Final = ", ".join([*_OTHER_ROUTES, *(str(r) for f in FAMILIES for r in f.routes)])


def match(method: str, path: str) -> Match | Miss:
    """The family and route ``method path`` asks for, or why none answers."""
    by_method = _EXACT.get(path)
    if by_method is not None:
        found = by_method.get(method)
        if found is not None:
            return found
        allow = ", ".join(by_method)
        return _not_allowed(method, path, allow, next(iter(by_method.values())).family)
    if path.startswith(_RESPONSES_PREFIX):
        return _stored_response(method, path)
    return _unknown(method, path)


def _stored_response(method: str, path: str) -> Match | Miss:
    rest = path[len(_RESPONSES_PREFIX) :]
    route = _RETRIEVE
    if rest.endswith(_CANCEL_SUFFIX):
        rest, route = rest[: -len(_CANCEL_SUFFIX)], _CANCEL
    if not rest or "/" in rest:
        return _unknown(method, path)
    if method != route.method:
        return _not_allowed(method, path, route.method, RESPONSES)
    return Match(RESPONSES, route, rest)


def _unknown(method: str, path: str) -> Miss:
    return Miss(
        404,
        "unknown_url",
        f"no such path: {clip(method)} {clip(path)}; this listener serves {_ALL_ROUTES}",
        "",
    )


def _not_allowed(method: str, path: str, allow: str, family: Family) -> Miss:
    return Miss(
        405,
        "method_not_allowed",
        f"{clip(method)} is not allowed on {clip(path)}; allowed: {allow}",
        allow,
        family,
    )


def routes_of(groups: Iterable[str]) -> str:
    """The routes a model serving ``groups`` answers, for the 404 a request of another group
    gets ("this model serves POST /v1/embeddings, ..."). Families in the table's order."""
    wanted = set(groups)
    return ", ".join(str(r) for f in FAMILIES if f.group in wanted for r in f.routes)


def engine_path(route: Route, engine_id: str | None = None) -> str:
    """The engine's path for ``route``: the client's, with the engine's own response id where
    the client sent the wrapped one. ``engine_id`` is required for a route with an id."""
    if _ID not in route.path:
        return route.path
    if not engine_id:
        raise ValueError(f"{route} needs the engine's response id (response_ids.unwrap)")
    return route.path.replace(_ID, engine_id)


def credential(family: Family, authorization: str | None, x_api_key: str | None) -> str | None:
    """The ``Authorization`` value the key check reads (``keys.KeyCache.authenticate``): the
    header itself when sent, else, on a family Anthropic's clients speak, ``x-api-key`` as a
    Bearer token. Authorization wins when both come: Anthropic's SDK sends it instead of
    ``x-api-key`` when given an auth token, and one request must not be two keys' at once."""
    if authorization is not None:
        return authorization
    if family.x_api_key and x_api_key:
        return f"Bearer {x_api_key}"
    return None


_OPERATIONS: Final[Mapping[Operation, str]] = {
    "create": "",
    "retrieve": "a stored response, from the replica its id names",
    "cancel": "cancels a stored (background) response, on the replica its id names",
}


def public_routes() -> list[dict[str, str]]:
    """The public listener's routes as the OpenAPI document lists them (the control plane's
    ``x-llmgw-public-routes``, docs/admin-api.md): method, path, API family, the API group a
    model must serve, how the key may come, the error shape, and how a request is routed."""
    rows = [
        {
            "method": "GET",
            "path": "/v1/models",
            "api": "models",
            "group": "",
            "key": "Authorization: Bearer",
            "errors": "openai",
            "routing": "none: the models the key may use",
        }
    ]
    for family in FAMILIES:
        for route in family.routes:
            if route.operation != "create":
                routing = _OPERATIONS[route.operation]
            elif family.generates:
                routing = "by prefix (KV cache) and load, flow-controlled"
            else:
                routing = "by load across the model's replicas"
            rows.append(
                {
                    "method": route.method,
                    "path": route.path,
                    "api": family.api,
                    "group": family.group,
                    "key": "Authorization: Bearer" + (" or x-api-key" if family.x_api_key else ""),
                    "errors": family.errors,
                    "routing": routing,
                }
            )
    return rows
