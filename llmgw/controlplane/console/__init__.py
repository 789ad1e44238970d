"""The operator's web console, served at ``/ui`` on the internal listener only.

Server-rendered pages (Jinja2) with vendored htmx for live fragments and uPlot for the one
chart, all shipped in the package: no CDN, no build step. Sign-in takes the admin token once
and hands out an HttpOnly, SameSite=Strict session cookie; every form carries a CSRF token.
Reads and writes go through the admin API in process (``admin_calls``).
"""

from llmgw.controlplane.console.routes import install_console

__all__ = ["install_console"]
