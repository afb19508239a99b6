"""The newcomer's main job: `graphdecode generate` on the built-in default model, offline."""

from __future__ import annotations

import hashlib
import json

from graphdecode.cli import main
from graphdecode.default_model import build_default_model


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_default_model_is_deterministic(tmp_path):
    build_default_model(str(tmp_path / "a"))
    build_default_model(str(tmp_path / "b"))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(tmp_path / "a" / name) == _digest(tmp_path / "b" / name)


def test_generate_on_the_default_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path))
    assert main(["generate", "--max-tokens", "5", "--json", "Hello", "The capital of France is"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "The capital of France is"]
    assert all(len(line["token_ids"]) == 5 and line["finish_reason"] == "length" for line in lines)
    assert (tmp_path / "default-llama-v1" / "model.safetensors").exists()
    # streaming and n > 1 through the CLI too
    assert main(["generate", "-n", "2", "--temperature", "0.8", "--seed", "1", "--max-tokens", "4", "--stream", "Hi"]) == 0
    out = capsys.readouterr().out
    assert "[" in out and "<length>" in out
