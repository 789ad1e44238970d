"""The tiny model's tokenizer files are what scripts/make-tiny-model.py makes, byte for byte:
the script is how they were made, and a change to either shows here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

_ROOT = Path(__file__).resolve().parents[2]
_DIR = _ROOT / "llmgw" / "tinymodel"


@pytest.mark.e2e
def test_the_committed_files_are_what_the_script_makes() -> None:
    done = subprocess.run(
        [sys.executable, str(_ROOT / "scripts" / "make-tiny-model.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_vocabulary_round_trips_text_and_keeps_chat_markers_whole() -> None:
    tok = Tokenizer.from_file(str(_DIR / "tokenizer.json"))
    text = "<|im_start|>user\nWhat is the capital of France? Ünïcode too.<|im_end|>\n"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert enc.tokens[0] == "<|im_start|>" and "<|im_end|>" in enc.tokens
    assert len(enc.ids) < len(text.encode())  # merges, not bytes alone
