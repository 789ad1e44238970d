"""The console's sign-in sessions: opaque ids in a cookie, each with its own CSRF token and
an absolute and an idle expiry.

Sessions live in this process's memory: a session id is worth nothing to another control plane
instance (behind a load balancer, pin the console to one instance), and a restart signs
everyone out. That is deliberate: a server-side table is what makes sign-out real (a signed
stateless cookie stays valid until it expires, whoever signed out).

What it must NOT do: read clocks, do I/O or hold the admin token; the caller passes ``now``.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass

__all__ = ["COOKIE", "Session", "SessionStore"]

# "__Host-" would bind the cookie to the exact origin, but browsers accept that prefix only with
# Secure, and the internal listener often serves plain HTTP on loopback.
COOKIE = "llmgw_console"


@dataclass(slots=True)
class Session:
    id: str
    csrf: str
    created_s: float
    seen_s: float


class SessionStore:
    """At most ``max_sessions``: signing in past that evicts the least recently seen one, so a
    flood of sign-ins (each needs the admin token) cannot grow memory without bound."""

    def __init__(self, *, ttl_s: float, idle_s: float, max_sessions: int = 1000) -> None:
        self.ttl_s = ttl_s
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._by_id: dict[str, Session] = {}

    def create(self, now: float) -> Session:
        self._expire(now)
        while len(self._by_id) >= self.max_sessions:
            oldest = min(self._by_id.values(), key=lambda s: s.seen_s)
            del self._by_id[oldest.id]
        s = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), now, now)
        self._by_id[s.id] = s
        return s

    def get(self, session_id: str | None, now: float) -> Session | None:
        """The live session with this id, its idle timer restarted; None when unknown or
        expired (an expired one is forgotten)."""
        if not session_id:
            return None
        s = self._by_id.get(session_id)
        if s is None:
            return None
        if now - s.created_s >= self.ttl_s or now - s.seen_s >= self.idle_s:
            del self._by_id[s.id]
            return None
        s.seen_s = now
        return s

    def end(self, session_id: str) -> None:
        self._by_id.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._by_id)

    def _expire(self, now: float) -> None:
        dead = [
            s.id
            for s in self._by_id.values()
            if now - s.created_s >= self.ttl_s or now - s.seen_s >= self.idle_s
        ]
        for sid in dead:
            del self._by_id[sid]

    @staticmethod
    def csrf_ok(session: Session, sent: str | None) -> bool:
        # Constant time: a byte-by-byte comparison leaks how much of a guess was right.
        return bool(sent) and hmac.compare_digest(session.csrf.encode(), (sent or "").encode())
