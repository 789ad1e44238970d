"""The API families the public listener serves (issue #38): what each answers and how it is
treated (``families``), what a body of each amounts to for routing and reservation
(``prompts``, over ``responses_input`` and ``messages_input``, which follow vLLM's own
conversions to chat, and ``chat_parts``, what they share), what an answer of each used
(``usage``, reading streams with ``sse``), Anthropic's error shape (``anthropic_errors``) and
the response ids that name their replica (``response_ids``).

Every module here is a pure core the gateway's request path calls: no sockets, no clocks of
its own, no asyncio, no settings read; what it needs (a secret, a clock, a template's trait)
is passed in. It must NOT import the gateway's shell (``llmgw.gateway.app`` and the modules
beside it): those call in, never the other way, so its tests drive it exactly as the shell
does.
"""
