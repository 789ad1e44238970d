"""The local tokenizer's pure pieces: what a set of tokenizer files must be, the piece cache's
bounds, and the gateway's LocalTokenizers bounds (too long, busy, a refused body, a verdict
that turns the files off, new files that are tried again)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.errors import SpecError
from llmgw.gateway.local_tokens import LocalTokenizers, Verdict
from llmgw.kv.hf_tokenizer import (
    MAX_FILE_BYTES,
    HfTokenizer,
    SegmentCache,
    TokenizerFiles,
    TokenizerFilesError,
)
from llmgw.simengine.hf_tokens import read_tokenizer_dir, tiny_model_dir

TINY = read_tokenizer_dir(tiny_model_dir())


def test_a_set_of_files_is_named_capped_and_content_addressed() -> None:
    with pytest.raises(TokenizerFilesError, match=r"tokenizer\.json"):
        TokenizerFiles({"tokenizer_config.json": b"{}"})
    with pytest.raises(TokenizerFilesError, match="not among"):
        TokenizerFiles({"tokenizer.json": b"{}", "model.safetensors": b""})
    with pytest.raises(TokenizerFilesError, match="over the cap"):
        TokenizerFiles({"tokenizer.json": b"x" * (MAX_FILE_BYTES + 1)})
    same = TokenizerFiles(dict(TINY.files))
    assert same.digest == TINY.digest
    changed = dict(TINY.files)
    changed["tokenizer_config.json"] += b" "
    assert TokenizerFiles(changed).digest != TINY.digest
    with pytest.raises(TokenizerFilesError, match="does not load"):
        HfTokenizer(TokenizerFiles({"tokenizer.json": b"{}"}))


def test_the_segment_cache_is_bounded_by_entries_and_characters() -> None:
    cache = SegmentCache(max_entries=3, max_chars=4000)
    for i in range(5):
        cache.put(f"{i}" * 300, (i,))
    assert len(cache) == 3 and cache.get("0" * 300) is None and cache.get("4" * 300) == (4,)
    cache.put("y" * 1001, (9,))  # over a quarter of the characters: never held
    assert cache.get("y" * 1001) is None
    for i in range(3):
        cache.put(chr(65 + i) * 900, (i,))
    assert sum(len(k) for k in cache._items) <= 4000


def test_a_template_that_raises_or_an_empty_chat_is_the_callers_error() -> None:
    tok = HfTokenizer(TINY)
    with pytest.raises(SpecError, match="messages is empty"):
        tok.render_chat([])
    with pytest.raises(SpecError, match="both true"):
        tok.render_chat([{"role": "user", "content": "x"}], continue_final_message=True)
    config = json.loads(TINY.files["tokenizer_config.json"])
    config["chat_template"] = "{{ raise_exception('no system role') }}"
    files = TokenizerFiles({**TINY.files, "tokenizer_config.json": json.dumps(config).encode()})
    with pytest.raises(SpecError, match="no system role"):
        HfTokenizer(files).render_chat([{"role": "user", "content": "x"}])
    # The sandbox: a template cannot reach Python's internals.
    config["chat_template"] = "{{ messages.__class__.__mro__ }}"
    files = TokenizerFiles({**TINY.files, "tokenizer_config.json": json.dumps(config).encode()})
    with pytest.raises(SpecError, match="unsafe"):  # jinja2's SecurityError, as the caller's
        HfTokenizer(files).render_chat([{"role": "user", "content": "x"}])


@pytest.mark.e2e  # the tokenizers run in worker processes
async def test_local_tokenizers_bound_and_distrust() -> None:
    local = LocalTokenizers(max_chars=5000, verify_first=1, verify_every=3)
    try:
        assert local.mode("m") == "remote"  # nothing loaded yet
        local.sync({"m": TINY})
        await local.settled()
        assert local.mode("m") == "local"
        body = {"prompt": "hello world"}
        got = await local.tokenize("m", body, chat=False, chars=11)
        assert isinstance(got, tuple) and got[1] is True  # the first is verified
        assert await local.tokenize("m", body, chat=False, chars=6000) == "too_long"
        assert await local.tokenize("m", {"prompt": 5}, chat=False, chars=1) == "unsupported"
        assert await local.tokenize("m", {"messages": []}, chat=True, chars=1) == "refused"
        samples = []
        for _ in range(6):
            got = await local.tokenize("m", body, chat=False, chars=11)
            assert isinstance(got, tuple)
            samples.append(got[1])
        assert samples == [False, True, False, False, True, False]  # then 1 in 3

        verdicts: list[Verdict] = []

        async def remote_differs() -> list[int] | str:
            return [1, 2, 3]

        local.verify("m", [1, 2, 4], remote_differs, verdicts.append)
        await local.settled()
        assert verdicts and not verdicts[0].match and verdicts[0].first_difference == 2
        assert local.mode("m") == "remote"
        assert await local.tokenize("m", body, chat=False, chars=11) == "unavailable"
        # The same files again change nothing; new files are tried again.
        local.sync({"m": TINY})
        assert local.mode("m") == "remote"
        config = json.loads(TINY.files["tokenizer_config.json"])
        config["model_max_length"] = 1024
        newer = TokenizerFiles({**TINY.files, "tokenizer_config.json": json.dumps(config).encode()})
        local.sync({"m": newer})
        await local.settled()
        assert local.mode("m") == "local" and local.digest("m") == newer.digest
    finally:
        local.close()


def test_a_tokenizer_whose_added_tokens_strip_is_encoded_whole(tmp_path: Path) -> None:
    raw = json.loads(TINY.files["tokenizer.json"])
    for token in raw["added_tokens"]:
        token["lstrip"] = True
    files = TokenizerFiles({**TINY.files, "tokenizer.json": json.dumps(raw).encode()})
    tok = HfTokenizer(files)
    assert not tok.segment_cached
    text = "hello   <|im_end|> world " * 40
    assert tok.encode(text, add_special_tokens=False) == tok._tok.encode(text).ids
