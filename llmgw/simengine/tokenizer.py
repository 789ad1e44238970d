"""The simulator's tokenizer: deterministic, offline, reversible, with a model-sized vocabulary.

Real tokenizers need downloaded files; the simulator must run anywhere, so its
vocabulary is *constructed*: five special tokens, 256 byte tokens (any text
round-trips through them), every lowercase letter string of length 1 to 3 in
four spellings (plain, leading space, Capitalised, space + Capitalised) and
every digit string of length 1 to 3 with and without a leading space: about
75,600 ids, so token ids look like a real model's and prompts take roughly
one token per three characters. The same text always gives the same ids in
every process (no hash randomisation is involved), which is what lets the
router's `/tokenize` call reproduce the blocks the engine caches.

Must NOT do I/O or depend on the engine: the HTTP shell and the tests use it
directly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice, product
from string import ascii_lowercase, digits
from typing import Final, NewType, Protocol

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "IM_END_ID",
    "IM_START_ID",
    "SPECIAL_TOKENS",
    "EngineTokenizer",
    "TokenId",
    "Tokenizer",
]

TokenId = NewType("TokenId", int)

PAD_ID: Final = 0
BOS_ID: Final = 1
EOS_ID: Final = 2
IM_START_ID: Final = 3
IM_END_ID: Final = 4
SPECIAL_TOKENS: Final[dict[str, int]] = {
    "<pad>": PAD_ID,
    "<s>": BOS_ID,
    "</s>": EOS_ID,
    "<|im_start|>": IM_START_ID,
    "<|im_end|>": IM_END_ID,
}
_FIRST_BYTE_ID: Final = len(SPECIAL_TOKENS)

# One alternative per piece kind; the order matters: special tokens first so
# "<s>" in a chat template is one id, then words chunked below, then digits,
# then any single character (which falls back to its UTF-8 bytes).
_PIECE_RE: Final = re.compile(
    r"<\|im_start\|>|<\|im_end\|>|</s>|<s>|<pad>"
    r"|( ?)([A-Z]?[a-z]+|[A-Z])"
    r"| ?[0-9]{1,3}"
    r"|[\s\S]"
)


class EngineTokenizer(Protocol):
    """What the engine, the sampler and the HTTP shell use of a tokenizer: this module's
    constructed one, or a model's tokenizer files (``hf_tokens.HfEngineTokenizer``)."""

    @property
    def vocab_size(self) -> int: ...
    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...
    def tokenize_within(
        self, text: str, *, add_special_tokens: bool = False, limit: int
    ) -> tuple[list[int] | None, int]: ...
    def detokenize(self, token_ids: Iterable[int], *, skip_special_tokens: bool = False) -> str: ...
    def piece(self, token_id: int) -> str: ...
    def word_piece_ids(self) -> Sequence[int]: ...


def _build_vocab() -> list[bytes]:
    pieces: list[bytes] = [s.encode() for s in SPECIAL_TOKENS]
    pieces.extend(bytes([b]) for b in range(256))
    for length in (1, 2, 3):
        for letters in product(ascii_lowercase, repeat=length):
            low = "".join(letters)
            cap = low.capitalize()
            pieces.extend((low.encode(), f" {low}".encode(), cap.encode(), f" {cap}".encode()))
    for length in (1, 2, 3):
        for numerals in product(digits, repeat=length):
            num = "".join(numerals)
            pieces.extend((num.encode(), f" {num}".encode()))
    return pieces


class Tokenizer:
    """Text <-> token ids; one instance per process (building the vocabulary takes ~50 ms)."""

    def __init__(self) -> None:
        self._pieces: list[bytes] = _build_vocab()
        # Byte tokens are found by arithmetic, not by this map: b"a" is both a byte token
        # and a word piece, and the word piece is the one tokenize() must produce.
        self._ids: dict[str, int] = {}
        for token_id, piece in enumerate(self._pieces):
            if token_id < _FIRST_BYTE_ID or token_id >= _FIRST_BYTE_ID + 256:
                self._ids[piece.decode()] = token_id
        self.vocab_size: Final[int] = len(self._pieces)

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = [BOS_ID] if add_special_tokens else []
        self._extend(ids, _PIECE_RE.finditer(text))
        return ids

    def tokenize_within(
        self, text: str, *, add_special_tokens: bool = False, limit: int
    ) -> tuple[list[int] | None, int]:
        """(ids, count) when the text has at most `limit` tokens, else (None, count).

        Past the limit the tokens are counted, not kept: a prompt that will be refused for
        its length then costs memory for `limit` tokens, not for all of them (a 16 MiB
        prompt is ~5M tokens, ~40 MB of list), and the refusal can still give the count.
        """
        ids: list[int] = [BOS_ID] if add_special_tokens else []
        dropped = 0
        matches = _PIECE_RE.finditer(text)
        while True:
            before = len(ids)
            self._extend(ids, islice(matches, 4096))
            if len(ids) == before:
                break
            if len(ids) > limit:
                dropped += len(ids)
                ids.clear()
        if dropped:
            return None, dropped + len(ids)
        return ids, len(ids)

    def _extend(self, ids: list[int], matches: Iterator[re.Match[str]]) -> None:
        """The one tokenizing loop (tokenize and tokenize_within both run it)."""
        lookup = self._ids
        for match in matches:
            word = match.group(2)
            if word is not None:
                # A word is cut into pieces of at most three letters; only the first keeps the
                # leading space and the capital, so every piece is in the vocabulary.
                ids.append(lookup[match.group(1) + word[:3]])
                for start in range(3, len(word), 3):
                    ids.append(lookup[word[start : start + 3]])
                continue
            piece = match.group(0)
            token_id = lookup.get(piece)
            if token_id is not None:
                ids.append(token_id)
            else:
                ids.extend(_FIRST_BYTE_ID + b for b in piece.encode())

    def detokenize(self, token_ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        pieces = self._pieces
        out = bytearray()
        for token_id in token_ids:
            if not 0 <= token_id < len(pieces):
                raise ValueError(
                    f"token id {token_id} is outside the simulator's vocabulary "
                    f"(0..{len(pieces) - 1}); send ids that /tokenize produced"
                )
            if skip_special_tokens and token_id < _FIRST_BYTE_ID:
                continue
            out += pieces[token_id]
        return out.decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str:
        """The text of one token (byte tokens of a multi-byte character decode to U+FFFD alone)."""
        return self._pieces[token_id].decode("utf-8", errors="replace")

    def word_piece_ids(self) -> Sequence[int]:
        """Ids of ' xy' / ' xyz' pieces: what the sampler draws output tokens from."""
        return [
            token_id
            for token_id, piece in enumerate(self._pieces)
            if len(piece) in (3, 4)
            and piece[:1] == b" "
            and piece[1:].isalpha()
            and piece[1:].islower()
        ]
