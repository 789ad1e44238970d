"""Registration (docs/architecture.md §5): a bootstrap token in, a node credential and the cluster id out.

Refusals write nothing: the token is checked (hash in constant time, then one atomic UPDATE
that takes a use only from a live token: not revoked, not expired, uses left), the node row
created and the status row written in ONE transaction, and any refusal after the token's use
was taken (the name is registered already) rolls that use back with the rest.

- The node's pool is the token's: a token is scoped to a pool, so a leaked token for the
  "batch" pool cannot enrol a machine into "prod".
- A token with ``require_approval`` makes the node pending: it syncs, reports its inventory
  and receives no shards until an admin approves it.
- A name that belongs to a registered node (one with a credential) is refused with 409: a
  second machine taking the name would inherit the first one's shards. An admin frees it by
  deleting that node; a row an admin created without a credential is claimed.
"""

from __future__ import annotations

import uuid

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from llmgw.controlplane.agentapi.metrics import AgentApiMetrics
from llmgw.controlplane.agentapi.nodes import NodeTable
from llmgw.errors import AuthError, ConflictError
from llmgw.logs import get_logger
from llmgw.protocol.sync import RegisterRequest, RegisterResponse
from llmgw.store.agent_nodes import claim_or_insert_node, upsert_node_status
from llmgw.store.bootstrap_tokens import (
    consume_bootstrap_token,
    read_bootstrap_token_hash,
)
from llmgw.store.credentials import (
    hash_matches,
    new_node_credential,
    parse_bootstrap_token,
    secret_sha256,
)

__all__ = ["RegisterHandler"]

log = get_logger("llmgw.controlplane.agentapi")

# One message for every token problem: telling "no such id" from "wrong secret" from
# "expired" would let a holder of a stolen id probe what it holds.
_BAD_TOKEN = (
    "the bootstrap token is not valid: unknown, wrong, expired, used up or revoked; create a "
    "new one (`llmgw tokens create`) and give it to the agent"
)


class _NameTaken(Exception):
    pass


class RegisterHandler:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        cluster_id: str,
        metrics: AgentApiMetrics,
        nodes: NodeTable,
    ) -> None:
        self.sessions = sessions
        self.cluster_id = cluster_id
        self.metrics = metrics
        self.nodes = nodes

    def _refuse_token(self, reason: str) -> AuthError:
        self.metrics.registrations.labels(reason).inc()
        self.metrics.auth_failures.labels("register", reason).inc()
        return AuthError(_BAD_TOKEN)

    async def register(self, request: RegisterRequest) -> RegisterResponse:
        token = parse_bootstrap_token(request.bootstrap_token)
        if token is None:
            raise self._refuse_token("malformed_token")
        node_id = uuid.uuid4()
        credential = new_node_credential(node_id)
        credential_hash = secret_sha256(credential.secret)
        try:
            async with self.sessions() as session, session.begin():
                stored = await read_bootstrap_token_hash(session, token.id)
                if not hash_matches(token.secret, stored):
                    raise self._refuse_token("wrong_token")
                grant = await consume_bootstrap_token(session, token.id)
                if grant is None:
                    raise self._refuse_token("expired_used_or_revoked")
                approval = "pending" if grant.require_approval else "approved"
                got = await claim_or_insert_node(
                    session,
                    node_id=node_id,
                    name=request.node_name,
                    credential_hash=credential_hash,
                    approval_state=approval,
                    pool=grant.pool,
                    token_id=grant.token_id,
                )
                if got is None:
                    raise _NameTaken
                node_id, approval_state = got
                await upsert_node_status(
                    session,
                    node_id,
                    mgmt_addr=request.mgmt_addr,
                    inventory=request.inventory,
                    agent_version=request.agent_version,
                )
        except (_NameTaken, IntegrityError):
            # IntegrityError: another registration of the same name committed first.
            self.metrics.registrations.labels("name_taken").inc()
            raise ConflictError(
                # Quoted whole: RegisterRequest bounds it (253 characters), and a cut name
                # would make the command below delete nothing.
                f"node name {request.node_name!r} is registered already; if this machine "
                "replaces that node, an admin deletes the node first (`llmgw nodes delete "
                f"{request.node_name}`), else give this agent another node_name",
            ) from None
        # The claimed row may have another id than the one the credential was made for.
        if node_id != credential.node_id:
            credential = type(credential)(node_id=node_id, secret=credential.secret)
        # After the commit: a sync that read the row before it must not be what is cached.
        self.nodes.registered(node_id)
        self.metrics.registrations.labels("ok").inc()
        log.info(
            "node_registered",
            node=str(node_id),
            name=request.node_name,
            pool=grant.pool,
            approval_state=approval_state,
            token=grant.token_id,
        )
        return RegisterResponse(
            node_id=str(node_id),
            node_credential=credential.plaintext,
            cluster_id=self.cluster_id,
            approval_state=approval_state,
        )
