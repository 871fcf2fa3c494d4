"""The fault battery, input side: pathological text, symlinked folders, inputs with nothing to ingest."""

from __future__ import annotations

import os

import pytest

from fusionrag.cli import main
from fusionrag.models import load_model
from fusionrag.prompt import PromptBuilder
from fusionrag.retrieval.chunking import Passage, expand_paths, make_chunks


class CountingTokenizer:
    """Wraps a tokenizer and counts the characters it is asked to encode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.chars = 0
        self.chat_template = getattr(inner, "chat_template", None)

    def encode(self, text, add_special_tokens=False):
        self.chars += len(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)


@pytest.mark.parametrize("kb", [20, 80])
def test_chunking_text_without_whitespace_is_linear(kb):
    """Before: 200 KB without whitespace took ~100 s to split (50 KB: 15 s): each probe re-tokenised the rest."""
    tok = CountingTokenizer(load_model("tiny-llama").tokenizer)
    prompt = PromptBuilder(tok)
    text = ("abcdefghij" * (kb * 100))[: kb * 1000]
    prompt.system_token_ids  # noqa: B018 - built once, not counted below
    tok.chars = 0
    chunks = make_chunks(prompt, [Passage("T", text)], 64)
    assert "".join(c.text for c in chunks) == text and all(len(c.token_ids) <= 64 for c in chunks)
    assert tok.chars < 40 * len(text), f"{tok.chars / len(text):.0f} characters tokenised per input character"


def test_a_folder_reached_through_a_symlink_is_read(tmp_path):
    """Before: a symlinked folder was silently skipped (files: 0, exit 0)."""
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "sub" / "a.txt").write_text("alpha")
    top = tmp_path / "top"
    top.mkdir()
    os.symlink(real, top / "linked")
    os.symlink(top, top / "loop")  # a cycle must not hang
    problems: list = []
    assert [p.name for p in expand_paths([top], problems)] == ["a.txt"] and not problems


def test_an_input_with_nothing_to_ingest_is_an_error(tmp_path, capsys, fusionrag_home):
    """Before: only empty/blank/binary files exited 0 with new_chunks 0."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    (tmp_path / "in" / "blank.md").write_text("   \n\n")
    (tmp_path / "in" / "bin.txt").write_bytes(b"\x00\x01\x02binary")
    code = main(["ingest", str(tmp_path / "in"), "--store", str(tmp_path / "kb"), "--model", "tiny-llama",
                 "--embedder", "hashing-64", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "nothing was ingested" in err and "Traceback" not in err
