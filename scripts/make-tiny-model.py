#!/usr/bin/env python3
"""Make the tiny model's tokenizer files, reproducibly: `llmgw/tinymodel/`.

A byte-level BPE (GPT-2's pre-tokenizer, so llama.cpp reads it as its `gpt-2` pre-tokenizer)
trained with the `tokenizers` library on the short corpus below, plus a ChatML chat template,
laid out as a Hugging Face model directory holds them (`tokenizer.json`,
`tokenizer_config.json`). The files are committed; this script is how they were made, and
`--check` fails when the committed files differ from what it makes (CI runs the check through
tests/engines/test_tiny_model.py).

Real-engine tests write a llama GGUF with random weights around this vocabulary
(tests/support/tiny_gguf.py): no weights are downloaded, and llama.cpp tokenizes, templates
and streams with its own code.

Usage: scripts/make-tiny-model.py [--out DIR] [--check]
Needs: pip install tokenizers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 384
BOS, EOS, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Enough English, code and numbers that the merges are ordinary ones; fixed, so the training
# is too.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A fleet of machines serves a model to many users.
Each replica holds the prefix of a prompt in its cache, and the router sends a request where
the prefix already is. The system prompt is the same for every request of a tenant: you are a
helpful assistant. Answer the question, then stop. What is the capital of France? Paris.
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
SELECT name, count(*) FROM requests GROUP BY name ORDER BY 2 DESC LIMIT 10;
1 2 3 4 5 6 7 8 9 10 100 1000 2026 3.14159 0.5 -1
Hello! Hi there. How are you today? I am fine, thank you. Good morning, good evening.
The engine starts, loads the weights, and listens on its port. The agent checks its health.
"""


def build() -> tuple[str, str]:
    """The two files' text: (tokenizer.json, tokenizer_config.json)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    return tok.to_str(pretty=True) + "\n", json.dumps(config, indent=2) + "\n"


def main() -> int:
    default_out = Path(__file__).resolve().parent.parent / "llmgw" / "tinymodel"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=default_out)
    ap.add_argument("--check", action="store_true", help="fail if the files differ")
    args = ap.parse_args()
    files = dict(zip(("tokenizer.json", "tokenizer_config.json"), build(), strict=True))
    if args.check:
        stale = [
            n
            for n, t in files.items()
            if not (args.out / n).is_file() or (args.out / n).read_text() != t
        ]
        if stale:
            print(f"stale: {', '.join(stale)} in {args.out}; run scripts/make-tiny-model.py")
            return 1
        print(f"up to date: {args.out}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (args.out / name).write_text(text)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
