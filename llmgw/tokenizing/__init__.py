"""Rendering and tokenizing with a model's tokenizer files in worker processes, off the event
loop: ``pool`` (the parent's side: a few workers, each call with a hard deadline past which
its worker is killed and replaced) and ``worker`` (the child: ``python -m
llmgw.tokenizing.worker``, the tokenizers it was sent by digest, every render within
``kv.template_budget``, its memory capped). The gateway tokenizes prompts there; the agent API
loads and try-renders uploaded files there before storing them.
"""
