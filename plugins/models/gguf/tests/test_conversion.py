"""A ``.gguf`` file as a model path (:mod:`core_rl_gguf.conversion`, through the ``gguf`` model source):
converted once into a cached Hugging Face directory that holds the same model (logits, tokenizer, chat
template, tied head, end-of-turn id) as transformers' own reading of the file, keyed by the file's
digest, and named in one line, with the source and its distribution, when it cannot be had."""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
from core_rl.plugins.host import PluginHost
from core_rl.roles.model_sources import HOME_ENV, resolve_model_paths
from core_rl.testing import preloaded
from core_rl.testing import real_model as real
from core_rl_gguf import conversion


@pytest.fixture(scope="module")
def real_gguf(real_model: Path) -> Path:
    """The real model's GGUF file (downloaded with it by the ``real_model`` fixture)."""
    found = real.cached_gguf()
    assert found is not None
    return found


def test_the_conversion_holds_the_model_transformers_reads_from_the_file(real_model: Path, real_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    assert real_model == conversion.converted_dir(conversion.file_digest(real_gguf))
    converted = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32)
    direct = AutoModelForCausalLM.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name, dtype=torch.float32)
    assert converted.config.tie_word_embeddings and converted.config.vocab_size == 49152
    assert converted.lm_head.weight.data_ptr() == converted.get_input_embeddings().weight.data_ptr()
    assert "quantization_config" not in converted.config.to_dict()

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    direct_tokenizer = AutoTokenizer.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)
    messages = [{"role": "user", "content": "What is 17 + 25? Answer with the number only."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == direct_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 17 + 25?" in text and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(ids, direct_tokenizer(text, return_tensors="pt").input_ids)
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, direct(ids).logits)

    generation = GenerationConfig.from_pretrained(real_model)
    assert tokenizer.convert_ids_to_tokens(generation.eos_token_id) == "<|im_end|>"
    record = (real_model / conversion.RECORD).read_text()
    assert conversion.file_digest(real_gguf) in record


def test_a_converted_file_is_found_by_its_digest_not_its_path(
    real_model: Path, real_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same bytes at another path reuse the cached directory (nothing converts again); changed
    bytes get a directory of their own."""

    def refuse(source: Path, out: Path) -> None:
        raise AssertionError(f"converted {source} again")

    monkeypatch.setattr(conversion, "convert", refuse)
    copy = tmp_path / "renamed" / real_gguf.name
    copy.parent.mkdir()
    shutil.copyfile(real_gguf, copy)
    assert conversion.ensure_converted(copy) == real_model
    with open(copy, "ab") as handle:
        handle.write(b"\0")
    assert conversion.converted_dir(conversion.file_digest(copy)) != real_model


def test_concurrent_processes_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of one run resolving the same new file at once: one converts, the others wait for it and
    take its directory; nothing half-written is ever returned."""
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF not really")
    calls: list[Path] = []

    def slow_convert(src: Path, out: Path) -> None:
        calls.append(out)
        threading.Event().wait(0.5)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(conversion, "convert", slow_convert)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(conversion.ensure_converted(source))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert (results[0] / "config.json").is_file() and (results[0] / conversion.RECORD).is_file()


@pytest.mark.parametrize("content", [b"not a gguf file at all", b"GGUF"], ids=["garbage", "cut-short"])
def test_a_failed_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes
) -> None:
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    source = tmp_path / "broken.gguf"
    source.write_bytes(content)
    with pytest.raises(conversion.GGUFError, match="broken.gguf: transformers cannot read it"):
        conversion.ensure_converted(source)
    target = conversion.converted_dir(conversion.file_digest(source))
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_config_problems_name_the_key_and_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the installed model sources, as the configuration loader asks them."""
    data = {
        "actor": {"model_path": str(tmp_path / "absent.gguf"), "tokenizer_path": ""},
        "reference": {"model_path": "/some/dir"},
    }
    before = {key: dict(section) for key, section in data.items()}
    assert resolve_model_paths(data, PluginHost()) == []  # a missing file: the preflight's to report
    assert data == before
    monkeypatch.setitem(sys.modules, "gguf", None)  # the package absent
    present = tmp_path / "present.gguf"
    present.write_bytes(b"x")
    monkeypatch.setenv(HOME_ENV, str(tmp_path / "home"))
    (problem,) = resolve_model_paths({"critic": {"model_path": str(present)}}, PluginHost())
    assert problem.startswith("critic.model_path: model source 'gguf' (distribution core-rl-gguf 0.1.0): ")
    needs = "reading a GGUF file needs the gguf package: pip install gguf (or core-rl[gguf])"
    assert problem.endswith(f"{present}: {needs}")


def test_core_rl_train_takes_a_gguf_model_path(real_model: Path, real_gguf: Path, tmp_path: Path) -> None:
    """``config show`` of a run whose ``actor.model_path`` is the GGUF file: valid, the path shown as
    the converted directory; ``core-rl train`` with a missing file: one line and exit 2."""

    from core_rl.testing.launch import write_grpo_config

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    config = write_grpo_config(tmp_path, real_gguf, [str(data)])
    cli = [sys.executable, "-m", "core_rl.cli", "config"]
    shown = preloaded.run([*cli, "show", str(config)], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert f"model_path: {real_model}" in shown.stdout
    missing = preloaded.run(
        [sys.executable, "-m", "core_rl.cli", "train", str(config), f"actor.model_path={tmp_path / 'gone.gguf'}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"actor.model_path: '{tmp_path / 'gone.gguf'}' does not exist" in missing.stderr
