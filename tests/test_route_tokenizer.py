"""``kvoffload route`` tokenizes prompts as the backends do, or refuses to start: a model whose
tokenizer it cannot load is one line ``error: model: ...`` and exit status 2, never a silent fall
back to byte-level ids (which key no block the backends cache). ``kvoffload serve`` keeps the
engine's fall back, and both decide a preset name before a directory of that name, as the
engine's loader does."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.cli.main import main
from kvoffload.serving.prompts import PromptTokenizer


def _word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "world": 6}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def _route(model: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["route", "--model", model, "--backend", "http://127.0.0.1:1"])
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("kind", ["hub name", "no tokenizer.json", "empty directory"])
def test_route_refuses_a_model_it_cannot_tokenize(kind, tmp_path, capsys) -> None:
    model = "Qwen/Qwen3-0.6B"  # a hub name: no checkpoint here to tokenize with
    if kind != "hub name":
        model = str(tmp_path)
        if kind == "no tokenizer.json":
            (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    code, lines = _route(model, capsys)
    assert code == 2
    (line,) = lines
    assert line.startswith("error: model: ") and "tokeniz" in line, line


def test_route_refuses_a_corrupt_tokenizer(tmp_path, capsys) -> None:
    (tmp_path / "tokenizer.json").write_text("{broken")
    code, lines = _route(str(tmp_path), capsys)
    assert code == 2
    (line,) = lines
    assert line.startswith("error: tokenizer: cannot read"), line


def test_route_tokenizes_with_the_checkpoints_tokenizer(tmp_path) -> None:
    _word_tokenizer(tmp_path)
    assert PromptTokenizer(str(tmp_path), require_tokenizer=True).encode("hello world") == [5, 6]


def test_serve_keeps_the_engines_byte_level_fall_back(tmp_path) -> None:
    assert PromptTokenizer(str(tmp_path)).encode("hi") == [104, 105]


def test_a_preset_name_wins_over_a_directory_of_that_name(tmp_path, monkeypatch) -> None:
    (tmp_path / "tiny").mkdir()
    _word_tokenizer(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    for strict in (False, True):
        assert PromptTokenizer("tiny", require_tokenizer=strict).encode("hello") == [
            104, 101, 108, 108, 111]
