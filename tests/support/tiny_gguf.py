"""A llama-architecture GGUF with random weights around the tiny model's vocabulary.

What llama-server needs to load a model and serve it with its own tokenizer, chat template and
sampler: 2 layers, 64 wide, the byte-level BPE in llmgw/tinymodel (made by
scripts/make-tiny-model.py), written with the `gguf` package the way llama.cpp's converter
writes a GPT-2-style vocabulary (`tokenizer.ggml.model = gpt2`, the `gpt-2` pre-tokenizer,
token types, merges, the special ids and the chat template). The weights are a fixed seed's
noise: the text it generates means nothing, the serving path is real. ~600 KB.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

__all__ = ["TINY_MODEL_DIR", "write_tiny_gguf"]

TINY_MODEL_DIR = Path(__file__).resolve().parents[2] / "llmgw" / "tinymodel"

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_CTX = 512


def _vocab(model_dir: Path) -> tuple[list[str], list[int]]:
    """Tokens in id order and their types, as the converter's get_vocab_base makes them."""
    data = json.loads((model_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in data["model"]["vocab"].items()}
    added = {a["id"]: a for a in data.get("added_tokens", [])}
    by_id.update({i: a["content"] for i, a in added.items()})
    tokens: list[str] = []
    types: list[int] = []
    for i in range(max(by_id) + 1):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            special = added[i].get("special", False)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def write_tiny_gguf(path: Path, *, model_dir: Path = TINY_MODEL_DIR, seed: int = 0) -> Path:
    tokens, types = _vocab(model_dir)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("llmgw-tiny")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(w)

    kv = N_EMBD // N_HEAD * N_HEAD_KV
    w.add_tensor("token_embd.weight", weight(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", weight(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_k.weight", weight(kv, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_v.weight", weight(kv, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_output.weight", weight(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output.weight", weight(n_vocab, N_EMBD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
