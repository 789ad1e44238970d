"""Secret references resolved on the node, at launch: `env:NAME` and `file:/path`.

A profile's secret_env maps a variable to a *reference*, so the secret itself
never passes through the control plane, its database or its logs: the
node resolves `env:NAME` from the agent's own environment (the unit file's
EnvironmentFile) and `file:/path` from a mounted secret. Resolved values go
into the engine's environment only, never back into a binding, a record or a
log line; errors name the reference, never a value. What a reference may look like
is llmgw.engines.secret_refs' one check, which the admin API runs before it stores a
profile; this module only reads what a checked reference points at.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from llmgw.engines import parse_secret_ref
from llmgw.errors import SpecError

__all__ = ["MAX_SECRET_BYTES", "resolve_secret_refs"]

# A secret is a token or a key, not a file to ship: a larger one is a wrong path.
MAX_SECRET_BYTES = 64 << 10


def _resolve(name: str, ref: str, environ: Mapping[str, str]) -> str:
    # The syntax is the control plane's check too (llmgw.engines.secret_refs): a profile it
    # stored passes here, and a spec that reached the node some other way is refused alike.
    checked = parse_secret_ref(name, ref)
    field = f"profile.secret_env.{name}"
    if checked.scheme == "env":
        if checked.target not in environ:
            raise SpecError(
                f"secret_env {name!r}: reference {ref!r} names a variable the agent's "
                f"environment does not have; set {checked.target} in the agent's unit file "
                "(EnvironmentFile)",
                field=field,
            )
        return environ[checked.target]
    path = Path(checked.target)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SECRET_BYTES + 1)
    except OSError as e:
        raise SpecError(
            f"secret_env {name!r}: cannot read {str(path)!r} ({e.strerror}) on this node",
            field=field,
        ) from None
    if len(data) > MAX_SECRET_BYTES:
        raise SpecError(
            f"secret_env {name!r}: {str(path)!r} is larger than {MAX_SECRET_BYTES} bytes; "
            "a secret file holds one token or key",
            field=field,
        )
    try:
        # A trailing newline is an editor's, not the secret's.
        return data.decode().rstrip("\r\n")
    except UnicodeDecodeError:
        raise SpecError(
            f"secret_env {name!r}: {str(path)!r} is not UTF-8 text", field=field
        ) from None


def resolve_secret_refs(refs: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """Variable name -> secret value, or SpecError naming the first bad reference."""
    return {name: _resolve(name, ref, environ) for name, ref in sorted(refs.items())}
