"""Tokenizing exactly as the engine does, from a model's own tokenizer files.

A Hugging Face model directory holds ``tokenizer.json`` (read by the ``tokenizers`` library,
the Rust tokenizer vLLM's fast tokenizers are) and a chat template (``chat_template.jinja``,
else ``tokenizer_config.json``'s ``chat_template``). ``HfTokenizer`` renders a chat the way
``transformers.apply_chat_template`` does (jinja2's immutable sandbox with ``trim_blocks`` and
``lstrip_blocks``, the ``tojson`` filter and the ``raise_exception`` / ``strftime_now``
globals HF templates call, the special tokens' strings, ``add_generation_prompt``,
``continue_final_message``, ``tools``, ``chat_template_kwargs``) and encodes it the way vLLM
does: a chat without special tokens unless asked (``add_special_tokens`` false), a completion
with them. The gateway routes on these tokens and the simulator caches under them: one code
path, so a token the router counts is a token the engine holds.

Shared prefixes are encoded once. ``tokenizers`` splits a text at its added tokens first and
encodes each piece between them on its own, so when every added token is matched verbatim
(not normalized, no stripping of the whitespace beside it, not single-word), the ids of a text
are exactly the concatenation of its pieces' ids: a long system prompt between two
``<|im_start|>`` markers is the same piece in every request, cached by its text
(``SegmentCache``). A tokenizer for which that does not hold is encoded whole, every time;
``segment_cached`` says which.

Safe from several threads (the simulator prepares large requests on threads); the gateway
renders and encodes with it in worker processes (``llmgw.tokenizing``). What it must NOT do:
I/O. It is given the files' bytes, never a path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from jinja2 import TemplateError
from tokenizers import Tokenizer

from llmgw.errors import SpecError, clip
from llmgw.kv.hf_chat_template import (
    check_chat_options,
    developer_as_system,
    knows_developer_role,
    message_text,
    pick_template,
    template_environment,
)
from llmgw.kv.template_budget import TemplateBudgetError, budget_for, render_within

__all__ = [
    "DEFAULT_MAX_RENDERED_CHARS",
    "MAX_FILES_BYTES",
    "MAX_FILE_BYTES",
    "TOKENIZER_FILE_NAMES",
    "HfTokenizer",
    "SegmentCache",
    "TokenizerFiles",
    "TokenizerFilesError",
]

# The files read of a model directory, and nothing else of it: the tokenizer, its config (the
# chat template, the special tokens), a separate template file (it wins over the config's, as
# in transformers >= 4.50) and the older special tokens map.
TOKENIZER_FILE_NAMES: Final = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)
# Large vocabularies' tokenizer.json run to ~35 MB (Gemma 3's 262k tokens); past these a file
# is not a tokenizer, and the store and every gateway would hold it.
MAX_FILE_BYTES: Final = 48 * 1024 * 1024
MAX_FILES_BYTES: Final = 64 * 1024 * 1024
# A rendered prompt's cap where the caller names none (the simulator): past any context length.
DEFAULT_MAX_RENDERED_CHARS: Final = 16 * 1024 * 1024
# Pieces shorter than this are encoded every time: a lookup costs about what encoding them does.
_SEGMENT_MIN_CHARS: Final = 256


class TokenizerFilesError(SpecError):
    """The files are not a tokenizer this module can use; the message names which and why."""


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """A model's tokenizer files, by name, content-addressed: ``digest`` names the set (the
    SHA-256 of the names and each file's SHA-256), so two nodes shipping the same files store
    them once and a gateway reloads only when the set changes."""

    files: Mapping[str, bytes]
    # Hashed once, at construction: a set is compared by its digest on every refresh of every
    # gateway (on its event loop), and 48 MB take ~100 ms to hash.
    _file_digests: Mapping[str, str] = field(init=False, repr=False, compare=False)
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.files) - set(TOKENIZER_FILE_NAMES))
        if unknown:
            raise TokenizerFilesError(
                f"tokenizer files {unknown} are not among {list(TOKENIZER_FILE_NAMES)}"
            )
        if "tokenizer.json" not in self.files:
            raise TokenizerFilesError(
                "no tokenizer.json: a model directory without one (a slow, sentencepiece-only "
                "tokenizer) cannot be tokenized locally; set the profile's tokenizer to none"
            )
        total = 0
        for name, data in self.files.items():
            if len(data) > MAX_FILE_BYTES:
                raise TokenizerFilesError(
                    f"{name} is {len(data)} bytes, over the cap of {MAX_FILE_BYTES}"
                )
            total += len(data)
        if total > MAX_FILES_BYTES:
            raise TokenizerFilesError(
                f"the tokenizer files are {total} bytes together, over {MAX_FILES_BYTES}"
            )
        shas = {name: hashlib.sha256(data).hexdigest() for name, data in self.files.items()}
        object.__setattr__(self, "_file_digests", shas)
        digest = hashlib.sha256(json.dumps(sorted(shas.items())).encode()).hexdigest()
        object.__setattr__(self, "digest", digest)

    def file_digests(self) -> dict[str, str]:
        """File name -> its SHA-256."""
        return dict(self._file_digests)


class SegmentCache:
    """Piece text -> its ids, least recently used out, bounded by entries and by characters.

    Called from several pool threads without a lock: each dict operation is atomic under
    the GIL, and the compound ones tolerate losing a race (a piece evicted between its get
    and its move to the end is simply not moved; the character count may drift by a
    piece, a bound that stays a bound)."""

    def __init__(self, *, max_entries: int = 4096, max_chars: int = 16 * 1024 * 1024) -> None:
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._chars = 0
        self._items: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, text: str) -> tuple[int, ...] | None:
        ids = self._items.get(text)
        if ids is None:
            self.misses += 1
            return None
        with contextlib.suppress(KeyError):
            self._items.move_to_end(text)
        self.hits += 1
        return ids

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        if len(text) > self._max_chars // 4 or text in self._items:
            return
        self._items[text] = ids
        self._chars += len(text)
        while len(self._items) > self._max_entries or self._chars > self._max_chars:
            try:
                old, _ = self._items.popitem(last=False)
            except KeyError:
                break
            self._chars -= len(old)

    def __len__(self) -> int:
        return len(self._items)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _json_file(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    raw = files.get(name)
    if raw is None:
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise TokenizerFilesError(f"{name} is not JSON: {clip(str(exc))}") from None
    if not isinstance(data, dict):
        raise TokenizerFilesError(f"{name} is not a JSON object")
    return data


_FIXED_KWARGS: Final = frozenset({"messages", "tools", "add_generation_prompt"})


class HfTokenizer:
    """One model's tokenizer, from its files. Raises ``TokenizerFilesError`` on files it cannot
    use (a tokenizer.json ``tokenizers`` refuses, a template that does not compile)."""

    def __init__(self, files: TokenizerFiles) -> None:
        self.digest = files.digest
        raw = files.files
        try:
            self._tok = Tokenizer.from_str(raw["tokenizer.json"].decode("utf-8"))
        except Exception as exc:
            raise TokenizerFilesError(
                f"tokenizer.json does not load: {clip(str(exc))}; ship the model's own file"
            ) from None
        config = _json_file(raw, "tokenizer_config.json")
        special_map = _json_file(raw, "special_tokens_map.json")
        self._specials: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(config.get(name)) or _token_text(special_map.get(name))
            if text is not None:
                self._specials[name] = text
        self._env = template_environment()
        self._templates: dict[bool, Any] = {}
        self._developer_role: dict[bool, bool] = {}
        for tools in (False, True):
            source = pick_template(config, raw, tools)
            self._developer_role[tools] = knows_developer_role(source)
            try:
                self._templates[tools] = self._env.from_string(source) if source else None
            except TemplateError as exc:
                raise TokenizerFilesError(
                    f"the chat template does not compile: {clip(str(exc))}"
                ) from None
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        verbatim = all(
            not (t.normalized or t.lstrip or t.rstrip or t.single_word) for t in added.values()
        )
        specials = sorted({t.content for t in added.values() if t.special}, key=len, reverse=True)
        self._split = (
            re.compile("(?=" + "|".join(re.escape(s) for s in specials) + ")")
            if verbatim and specials
            else None
        )
        self._affixes = self._post_affixes()
        self.segment_cache = SegmentCache()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def segment_cached(self) -> bool:
        """Whether shared pieces are encoded once (see the module's docstring)."""
        return self._split is not None

    @property
    def has_chat_template(self) -> bool:
        return self._templates[False] is not None

    def _post_affixes(self) -> tuple[list[int], list[int]] | None:
        """The ids the post-processor adds around one sequence (BOS, EOS), found by encoding
        two probes with and without them; None when they are not a fixed prefix and suffix."""
        found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for probe in ("a", "hello world 42"):
            plain = self._tok.encode(probe, add_special_tokens=False).ids
            full = self._tok.encode(probe, add_special_tokens=True).ids
            at = next(
                (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain),
                None,
            )
            if at is None:
                return None
            found.add((tuple(full[:at]), tuple(full[at + len(plain) :])))
        if len(found) != 1:
            return None
        prefix, suffix = found.pop()
        return list(prefix), list(suffix)

    # --- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """The ids of ``text`` as ``tokenizer.encode(text, add_special_tokens=...)`` gives them."""
        if self._split is None or (add_special_tokens and self._affixes is None):
            return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        ids: list[int] = []
        if add_special_tokens and self._affixes is not None:
            ids.extend(self._affixes[0])
        # Short pieces between long ones are encoded together, one call per run of them: the
        # concatenation of pieces split at special tokens encodes as the pieces do.
        pending: list[str] = []
        cache = self.segment_cache
        encode = self._tok.encode
        for piece in self._split.split(text):
            if len(piece) < _SEGMENT_MIN_CHARS:
                pending.append(piece)
                continue
            if pending:
                ids.extend(encode("".join(pending), add_special_tokens=False).ids)
                pending.clear()
            got = cache.get(piece)
            if got is None:
                got = tuple(encode(piece, add_special_tokens=False).ids)
                cache.put(piece, got)
            ids.extend(got)
        if pending:
            ids.extend(encode("".join(pending), add_special_tokens=False).ids)
        if add_special_tokens and self._affixes is not None:
            ids.extend(self._affixes[1])
        return ids

    def uncached_chars(self, text: str) -> int:
        """How many of the text's characters ``encode`` would encode rather than read from the
        segment cache (all of them for a tokenizer that cannot cache pieces)."""
        if self._split is None:
            return len(text)
        items = self.segment_cache._items
        return sum(
            len(piece)
            for piece in self._split.split(text)
            if len(piece) < _SEGMENT_MIN_CHARS or piece not in items
        )

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        got = self._tok.id_to_token(token_id)
        return None if got is None else str(got)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # --- chat -------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_chars: int = DEFAULT_MAX_RENDERED_CHARS,
    ) -> str:
        """The prompt text of a chat, as the engine renders it. Raises ``SpecError`` for what
        the engine refuses too (both generation prompt and continuation, no messages, a
        template that raises, or fails on a value of the messages: a ``TypeError`` or
        ``ValueError``), ``TemplateBudgetError`` (a ``SpecError``) for a render past its
        budget: over ``max_chars`` characters of output, or a template whose work outgrows
        the chat (``template_budget``)."""
        check_chat_options(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        template = self._templates[bool(tools)]
        if template is None:
            raise SpecError(
                "this model's tokenizer files have no chat template; send a completion "
                "(prompt) instead",
                field="messages",
            )
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise SpecError(f"messages[{i}] is not an object", field=f"messages[{i}]")
            chat.append({**message, "content": message_text(message.get("content"))})
        if not self._developer_role[bool(tools)] and any(
            m.get("role") == "developer" for m in chat
        ):
            chat = developer_as_system(chat)
        context: dict[str, Any] = dict(self._specials)
        for name, value in (chat_template_kwargs or {}).items():
            if name not in _FIXED_KWARGS:
                context[name] = value
        context.update(
            messages=chat, tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
        )  # fmt: skip
        try:
            rendered = render_within(template, context, budget_for(context, max_chars))
        except TemplateBudgetError:
            raise
        except TemplateError as exc:
            raise SpecError(f"the chat template refused the request: {clip(str(exc))}") from None
        except (TypeError, ValueError) as exc:
            # A value the template cannot use (a null content it concatenates, a number it
            # iterates): the body's fault, as vLLM answers it (400), never a 500.
            raise SpecError(
                f"the chat template cannot render these messages: {type(exc).__name__}: "
                f"{clip(str(exc))}; send each message's content as text",
                field="messages",
            ) from None
        if continue_final_message:
            final = (chat[-1].get("content") or "").strip()
            at = rendered.rfind(final) if final else -1
            if at < 0:
                raise SpecError(
                    "continue_final_message: the final message is not in the rendered chat",
                    field="continue_final_message",
                )
            rendered = rendered[: at + len(final)]
        return rendered

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.encode(text, add_special_tokens=add_special_tokens)

    def render_request(
        self, body: Mapping[str, Any], *, chat: bool, max_chars: int = DEFAULT_MAX_RENDERED_CHARS
    ) -> tuple[str, bool] | None:
        """(the text the engine tokenizes for an OpenAI request body, whether with special
        tokens); None for a body this cannot tokenize (a completion whose prompt is not one
        string). Raises ``SpecError`` where the engine would refuse the request, and
        ``TemplateBudgetError`` ("output") for a prompt over ``max_chars`` characters."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            kwargs = body.get("chat_template_kwargs")
            tools = body.get("tools")
            text = self.render_chat(
                messages,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                tools=tools if isinstance(tools, list) else None,
                chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
                max_chars=max_chars,
            )
            return text, bool(body.get("add_special_tokens", False))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        if len(prompt) > max_chars:
            raise TemplateBudgetError(
                "output", f"the prompt is {len(prompt)} characters, over {max_chars}"
            )
        return prompt, bool(body.get("add_special_tokens", True))

    def request_ids(self, body: Mapping[str, Any], *, chat: bool) -> list[int] | None:
        """The prompt ids of an OpenAI request body as the engine tokenizes it (see
        ``render_request``)."""
        rendered = self.render_request(body, chat=chat)
        if rendered is None:
            return None
        return self.encode(rendered[0], add_special_tokens=rendered[1])
