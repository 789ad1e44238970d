"""The simulator's tokenizer and chat template: reversible, deterministic, model-sized."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.errors import SpecError
from llmgw.simengine.chat_template import render_chat
from llmgw.simengine.tokenizer import BOS_ID, IM_END_ID, IM_START_ID, Tokenizer

TOKENIZER = Tokenizer()


@settings(deadline=None, max_examples=300)
@given(st.text())
def test_detokenize_inverts_tokenize(text: str) -> None:
    ids = TOKENIZER.tokenize(text)
    assert TOKENIZER.detokenize(ids) == text
    assert all(0 <= i < TOKENIZER.vocab_size for i in ids)


def test_vocabulary_is_model_sized_and_prose_compresses() -> None:
    assert 30_000 < TOKENIZER.vocab_size < 200_000
    text = "The quick brown fox jumps over the lazy dog. " * 20
    ids = TOKENIZER.tokenize(text)
    assert len(text) / len(ids) > 2.0
    assert max(ids) > 10_000  # ids spread over the vocabulary like a real model's


@pytest.mark.e2e
def test_tokens_are_identical_in_another_process() -> None:
    # The router tokenizes through one replica and hashes; another replica must agree, whatever
    # its PYTHONHASHSEED (str hashing is randomised per process, so a hash-based vocab would not).
    text = "Routing by prefix only works if every replica tokenizes alike. 42 ünïcödé"
    code = (
        "from llmgw.simengine.tokenizer import Tokenizer;"
        f"print(Tokenizer().tokenize({text!r}, add_special_tokens=True))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "987", "PATH": "/usr/bin:/bin"},
    ).stdout
    assert out.strip() == str(TOKENIZER.tokenize(text, add_special_tokens=True))


def test_special_tokens_in_text_are_single_ids() -> None:
    ids = TOKENIZER.tokenize("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=True)
    assert ids[0] == BOS_ID and ids[1] == IM_START_ID and IM_END_ID in ids


def test_chat_template_is_fixed_chatml() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    assert render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(messages, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|im_start|>user\nHi"
    )
    with pytest.raises(SpecError, match="both true"):
        render_chat(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(SpecError, match="image_url"):
        render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_tokenize_within_keeps_ids_up_to_the_limit_and_only_counts_past_it() -> None:
    tok = Tokenizer()
    text = "Hello world, 12345 <|im_end|> café " * 3000
    full = tok.tokenize(text, add_special_tokens=True)
    assert tok.tokenize_within(text, add_special_tokens=True, limit=len(full)) == (full, len(full))
    assert tok.tokenize_within(text, add_special_tokens=True, limit=len(full) - 1) == (
        None,
        len(full),
    )
    assert tok.tokenize_within("", limit=0) == ([], 0)
