"""Request and response bodies of the admin API (pydantic, at the boundary only): what every
resource's bodies share (names and bounds, the request and response bases, errors, a page)
and the models'. Profiles' are in ``schemas_profiles``, declared adapters' in
``schemas_adapters``, deployments' in ``schemas_deployments``, the fleet half's (nodes,
tokens, replicas, actions, GPU classes, apply) in ``schemas_fleet``.

Every request model forbids unknown fields: a misspelt ``replica`` must be a
422 naming it, not a silently ignored key and a deployment with the default
count. Updates carry the ``version`` the client last read (optimistic
concurrency); every other update field is optional and means "leave as is"
when absent.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Generic, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    field_validator,
)

from llmgw.protocol.names import NAME_PATTERN, segment_problem

__all__ = [
    "INT32_MAX",
    "LIMITS",
    "Description",
    "ErrorBody",
    "ErrorDetail",
    "ModelCreate",
    "ModelOut",
    "ModelUpdate",
    "Name",
    "Page",
    "segment_problem",
]

# Bounds on what one request may store. Each is far above any real profile (vLLM's longest
# command lines run to a few dozen args), and low enough that a body at the size cap cannot
# become a row that every agent sync then copies to every node. A value past one is a 422
# naming the field and the bound ("args.3: String should have at most 4096 characters").
LIMITS: dict[str, int] = {
    "description_chars": 4096,
    "args_items": 512,
    "arg_chars": 4096,
    "env_items": 256,
    "env_name_chars": 256,
    "env_value_chars": 8192,
    "secret_ref_chars": 1024,
    "adapters_items": 128,
    "path_chars": 4096,
    "short_text_chars": 256,
}


def _segments_ok(name: str) -> str:
    # What the pattern of ``Name`` does not say already: its slashes (``llmgw.protocol.names``,
    # the one rule).
    problem = segment_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN), AfterValidator(_segments_ok)]
Description = Annotated[str, StringConstraints(max_length=LIMITS["description_chars"])]
# Postgres' 32-bit integer columns: a count above it is a 422 naming the field, not a database
# error.
INT32_MAX = 2**31 - 1


def _storable(value: object) -> object:
    # Never put the value in the message: it may be a secret reference.
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("must not contain a NUL character (Postgres cannot store it)")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            # JSON allows "\ud800"; UTF-8 and Postgres do not. Unchecked, it failed inside the
            # database as a 500, with the value quoted in Postgres' own log.
            raise ValueError(
                "must be valid Unicode: it holds a lone surrogate (a \\ud800-\\udfff escape "
                "without its pair), which cannot be stored; send the character itself or its "
                "full surrogate pair"
            ) from None
    elif isinstance(value, list | tuple):
        for v in value:
            _storable(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _storable(k)
            _storable(v)
    elif isinstance(value, BaseModel):
        _storable(value.model_dump())
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    _strings_storable = field_validator("*")(_storable)


class _Response(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorDetail(BaseModel):
    code: str = Field(
        description="Stable, machine-readable: spec-invalid, conflict, not-found, ..."
    )
    message: str
    field: str | None = Field(default=None, description="Dotted path of the offending input.")


class ErrorBody(BaseModel):
    error: ErrorDetail


_Item = TypeVar("_Item")


class Page(BaseModel, Generic[_Item]):
    """One page of a list, in name order."""

    items: list[_Item]
    next_cursor: str | None = Field(
        description="Opaque: pass it as ?cursor= for the next page. None: this is the last page."
    )


# --- models -----------------------------------------------------------------


class ModelCreate(_Request):
    name: Name
    description: Description = ""


class ModelUpdate(_Request):
    version: StrictInt = Field(
        ge=1, le=INT32_MAX, description="The version you read; a stale one gets 409."
    )
    description: Description | None = None


class ModelOut(_Response):
    name: str
    description: str
    version: int
    created_at: datetime
    updated_at: datetime
