"""The simulator's tokenizer from a model's tokenizer files (``--tokenizer DIR``).

The same ``llmgw.kv.hf_tokenizer.HfTokenizer`` the gateway routes with: the simulator renders
its chats with the files' chat template and encodes with ``tokenizers``, exactly the code path
a vLLM model directory takes, so a gateway tokenizing locally from the files its agent shipped
gets the ids this engine caches. ``sim://`` models use the project's tiny model
(``llmgw/tinymodel``) unless a profile names other files.

Presents the constructed ``Tokenizer``'s interface (tokenize, tokenize_within, detokenize,
piece, word_piece_ids, vocab_size) so the engine, sampler and HTTP shell take either.
Must NOT do I/O but reading the named directory's tokenizer files once, at start.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from llmgw.engines.sim import TINY_MODEL_DIR
from llmgw.kv.hf_tokenizer import (
    MAX_FILE_BYTES,
    TOKENIZER_FILE_NAMES,
    HfTokenizer,
    TokenizerFiles,
    TokenizerFilesError,
)

__all__ = ["HfEngineTokenizer", "read_tokenizer_dir", "tiny_model_dir"]


def tiny_model_dir() -> Path:
    """The packaged tiny model's directory (its tokenizer.json and tokenizer_config.json)."""
    return Path(TINY_MODEL_DIR)


def read_tokenizer_dir(directory: Path) -> TokenizerFiles:
    """The tokenizer files of a model directory: the named files only, each capped."""
    if not directory.is_dir():
        raise TokenizerFilesError(
            f"{directory} is not a directory; name a model directory holding tokenizer.json"
        )
    files: dict[str, bytes] = {}
    for name in TOKENIZER_FILE_NAMES:
        path = directory / name
        if not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            raise TokenizerFilesError(f"{path} is over the cap of {MAX_FILE_BYTES} bytes")
        files[name] = path.read_bytes()
    return TokenizerFiles(files)


class HfEngineTokenizer:
    """The engine's view of an ``HfTokenizer``."""

    def __init__(self, hf: HfTokenizer) -> None:
        self.hf = hf
        self.vocab_size = hf.vocab_size

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def tokenize_within(
        self, text: str, *, add_special_tokens: bool = False, limit: int
    ) -> tuple[list[int] | None, int]:
        # The body cap bounds the text (16 MiB by default); tokenizers holds it whole anyway.
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens)
        return (ids if len(ids) <= limit else None), len(ids)

    def detokenize(self, token_ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        ids = list(token_ids)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the model's vocabulary (0..{self.vocab_size - 1}); "
                "send ids that /tokenize produced"
            )
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str:
        return self.hf.decode([token_id])

    def word_piece_ids(self) -> Sequence[int]:
        """Ids decoding to a space and two or more lowercase letters: what the sampler draws
        from (any plain, non-special id where the vocabulary has none of those)."""
        words = []
        plain = []
        for token_id in range(self.vocab_size):
            if self.hf.is_special(token_id):
                continue
            text = self.hf.decode([token_id])
            if text.isprintable() and text.strip():
                plain.append(token_id)
            if len(text) >= 3 and text[0] == " " and text[1:].isalpha() and text[1:].islower():
                words.append(token_id)
        return words or plain

    def chat_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Any] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        return self.hf.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
