"""ASGI pieces the control plane's listeners share: error bodies, request ids and the
access log, admin authentication before any body is read, and body caps.

Pure ASGI (no ``BaseHTTPMiddleware``): a wrapper must never buffer a streamed
response, since the gateway's token streams will pass through the same stack.
"""

__all__: list[str] = []
