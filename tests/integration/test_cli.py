"""The `brigade` command line end to end: generate, bad inputs, help. (`brigade serve`, which
starts the cluster, is tests/integration/test_serve.py.)

Every CLI process imports torch and loads the tiny preset (seconds on a shared CPU), so the
real-process runs start together once per module and tests share their results. Bad inputs
are checked in-process through cli.main() — the code path the console script runs — and
one of them again in a real process for the exit code.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import cli

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "cluster.cli"]
# The CPU default is a 256 MiB pool (tests need a few blocks); float32 because the prompts-file
# run is compared with runs alone (other batch compositions), and `auto` may pick bfloat16.
ENGINE_FLAGS = ["--num-blocks", "256", "--dtype", "float32"]
TEXT_PROMPT = "hello world"
PROMPTS_FILE = [
    {"prompt_ids": [1, 2, 3]},  # --max-tokens 5 from the flag
    {"prompt": TEXT_PROMPT, "max_tokens": 8},
    {"prompt_ids": [1, 2, 3], "max_tokens": 3},
]


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each real-process run, all started at once."""
    from engine.presets import materialize

    materialize("tiny")  # once, rather than raced by every process
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in PROMPTS_FILE))
    procs = {
        "ids": _start("generate", "--prompt-ids", "1,2,3", "--max-tokens", "5", "--json", *ENGINE_FLAGS),
        "text": _start("generate", "--prompt", TEXT_PROMPT, "--max-tokens", "8", *ENGINE_FLAGS),
        "file": _start("generate", "--prompts-file", str(prompts), "--max-tokens", "5", "--json", *ENGINE_FLAGS),
        "bad": _start("generate", "--prompt", "hi", "--temperature", "-1"),
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        results[name] = (proc.returncode, out, err)
    return results


def test_generate_prompt_ids_json(runs) -> None:
    code, out, err = runs["ids"]
    assert code == 0, err
    [line] = out.splitlines()
    result = json.loads(line)
    assert len(result["token_ids"]) == 5
    assert result["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0, "cached_by_tier": {}}
    assert set(result) == {"token_ids", "text", "finish_reason", "usage"}


def test_generate_text_prompt_prints_text_and_usage(runs) -> None:
    code, out, err = runs["text"]
    assert code == 0, err
    assert out.strip()
    assert "prompt + 8 completion tokens" in err


def test_prompts_file_matches_individual_runs_in_input_order(runs) -> None:
    code, out, err = runs["file"]
    assert code == 0, err
    first, second, third = (json.loads(line) for line in out.splitlines())
    alone = json.loads(runs["ids"][1])
    assert first == alone
    assert second["text"] + "\n" == runs["text"][1]
    # Greedy: the same prompt with fewer tokens is a prefix of the longer run.
    assert third["token_ids"] == alone["token_ids"][:3] and third["finish_reason"] == "length"


def test_bad_input_in_a_real_process_exits_2_without_traceback(runs) -> None:
    code, out, err = runs["bad"]
    assert code == 2 and out == ""
    assert err.startswith("error: temperature") and "Traceback" not in err


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    (root / "no-config").mkdir()
    (root / "gpt2").mkdir()
    (root / "gpt2" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    (root / "no-weights").mkdir()
    from engine.presets import PRESETS

    (root / "no-weights" / "config.json").write_text(json.dumps(PRESETS["tiny"].config))
    (root / "bad-json.jsonl").write_text('{"prompt": "ok"}\n\n{"prompt": "broken"\n')
    (root / "bad-key.jsonl").write_text('{"prompt": "ok"}\n{"promt": "typo"}\n')
    (root / "bad-type.jsonl").write_text('{"prompt": "ok", "temperature": "hot"}\n')
    (root / "bad-ids.jsonl").write_text('{"prompt": "ok"}\n{"prompt_ids": [1, 99999]}\n')
    (root / "empty.jsonl").write_text("\n")
    return root


BAD_INPUTS = {
    # name: (generate args, with {dir} for the bad_files dir; what the message must say)
    "unknown architecture": (["--model", "{dir}/gpt2"], "unsupported architecture"),
    "dir without config.json": (["--model", "{dir}/no-config"], "config.json"),
    "missing safetensors": (["--model", "{dir}/no-weights"], "model.safetensors"),
    "bogus preset": (["--model", "tiny-typo"], "preset"),
    "prompt over the context": (["--prompt-ids", ",".join(["5"] * 4097)], "context is 4096"),
    "token id out of vocabulary": (["--prompt-ids", "1,99999"], "token id 99999"),
    "negative temperature": (["--temperature", "-1"], "change --temperature"),
    "top_p zero": (["--top-p", "0"], "top_p"),
    "top_p above one": (["--top-p", "1.5"], "top_p"),
    "max_tokens over the context": (["--max-tokens", "5000"], "change --max-tokens"),
    "malformed prompt ids": (["--prompt-ids", "1,x,3"], "comma-separated token ids"),
    "missing prompts file": (["--prompts-file", "{dir}/nope.jsonl"], "cannot read prompts file"),
    "prompts file bad JSON": (["--prompts-file", "{dir}/bad-json.jsonl"], "bad-json.jsonl line 3"),
    "prompts file unknown key": (["--prompts-file", "{dir}/bad-key.jsonl"], "line 2: unknown key(s) promt"),
    "prompts file bad type": (["--prompts-file", "{dir}/bad-type.jsonl"], "line 1: temperature: must be a number"),
    "prompts file bad token": (["--prompts-file", "{dir}/bad-ids.jsonl"], "line 2: prompt: token id 99999"),
    "empty prompts file": (["--prompts-file", "{dir}/empty.jsonl"], "has no prompts"),
    "chat with token ids": (["--prompt-ids", "1,2", "--chat"], "--chat needs a text prompt"),
    "too few blocks": (["--num-blocks", "1"], "--num-blocks: Input should be greater than or equal to 2"),
    "bad device": (["--device", "gpu"], "argument --device"),
    "negative hicache budget": (["--hicache", "--hicache-host-bytes", "-1"], "--hicache-host-bytes: Input should be"),
    "no prompt": ([], "one of the arguments --prompt --prompt-ids --prompts-file is required"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_error_line_and_exit_2(name: str, bad_files: Path, capsys) -> None:
    args, expected = BAD_INPUTS[name]
    args = [a.replace("{dir}", str(bad_files)) for a in args]
    if not any(a.startswith("--prompt") for a in args) and name != "no prompt":
        args += ["--prompt", "hi"]
    if "--num-blocks" not in args:
        args += ["--num-blocks", "64"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", *args])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err and "Traceback" not in err


def test_chat_wraps_the_prompt_in_the_template(capsys) -> None:
    from engine.presets import materialize
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(materialize("tiny"))
    expected = tok.encode(tok.apply_chat_template([{"role": "user", "content": TEXT_PROMPT}]))
    assert cli.main(["generate", "--prompt", TEXT_PROMPT, "--chat", "--max-tokens", "2", "--json",
                     "--num-blocks", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["usage"]["prompt_tokens"] == len(expected)


def test_prompts_file_from_stdin(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"prompt_ids": [1, 2, 3], "max_tokens": 2}\n'))
    assert cli.main(["generate", "--prompts-file", "-", "--json", "--num-blocks", "64"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2


def test_flags_map_to_one_engine_config() -> None:
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--model", "tiny-moe", "--block-size", "8",
                                          "--num-blocks", "64", "--max-num-batched-tokens", "256",
                                          "--dtype", "float32", "--device", "cpu", "--seed", "3"])
    config = cli.engine_config(args)
    assert (config.model, config.dtype, config.device, config.seed) == ("tiny-moe", "float32", "cpu", 3)
    assert (config.cache.block_size, config.cache.num_blocks) == (8, 64)
    assert config.scheduler.max_num_batched_tokens == 256
    defaults = cli.engine_config(cli.build_parser().parse_args(["generate", "--prompt", "x"]))
    assert defaults.cache.num_blocks is None and defaults.cache.block_size == 16


def test_generate_with_hicache_tiers(tmp_path: Path, capsys) -> None:
    cache_dir = tmp_path / "kv"
    assert cli.main(["generate", "--prompt-ids", ",".join(map(str, range(3, 40))), "--max-tokens", "2", "--json",
                     "--num-blocks", "64", "--block-size", "4", "--hicache", "--hicache-host-bytes", "0",
                     "--hicache-disk-dir", str(cache_dir)]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2
    assert cache_dir.stat().st_mode & 0o777 == 0o700
    assert len(list(cache_dir.glob("*.kv"))) == 9  # host budget 0: every full prompt block went to disk


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"]])
def test_help_teaches_with_examples(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    assert "examples:\n  brigade " in capsys.readouterr().out
