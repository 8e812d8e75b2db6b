"""The command line as vLLM users type it: a positional model, vLLM's flags with vLLM's meaning (or
an error naming the flag and the value where ferry has no such value), help with every flag's
default, unknown flags reported by their subcommand with the closest matches, and --version."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from ferry import __version__
from ferry.cli import main
from ferry.engine_args import CommandParser, add_engine_args

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from ferry.server.cli import add_server_args  # noqa: E402
from test_server import REPO, free_port, make_tiny_served_model  # noqa: E402

VLLM_FLAGS = ["--tensor-parallel-size", "--disable-log-requests", "--trust-remote-code", "--tokenizer",
              "--chat-template", "--kv-cache-dtype", "--quantization", "--enable-auto-tool-choice",
              "--tool-call-parser", "--uvicorn-log-level", "--enable-chunked-prefill", "--generation-config",
              "--swap-space", "--disable-log-stats"]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_version(capsys):
    for argv in (["--version"], ["serve", "--version"]):
        code, out = run_cli(capsys, *argv)
        assert code == 0 and out.strip() == f"ferry {__version__}"


def test_serve_help_documents_every_flag_with_its_default(capsys):
    code, out = run_cli(capsys, "serve", "--help")
    assert code == 0
    for flag in VLLM_FLAGS + ["--max-model-len", "--gpu-memory-utilization", "--max-queue-wait", "--api-key"]:
        assert flag in out, flag
    parser = CommandParser(prog="ferry serve")
    add_engine_args(parser)
    add_server_args(parser)
    undocumented = [a.option_strings[0] for a in parser._actions
                    if a.option_strings and a.help in (None, "") and not isinstance(a, argparse._HelpAction)]
    assert not undocumented, undocumented
    assert out.count("(default:") >= 40


@pytest.mark.parametrize("argv,message", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: ferry runs on one GPU"),
    (["-tp", "4"], "--tensor-parallel-size 4"),
    (["--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2'"),
    (["--quantization", "awq"], "argument --quantization/-q: invalid choice: 'awq'"),
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512"],
     "max_num_batched_tokens (512) is smaller than max_model_len (2048)"),
])
def test_values_ferry_lacks_are_errors_naming_the_flag(capsys, argv, message):
    code, out = run_cli(capsys, "serve", *argv)
    assert code == 2 and message in out


def test_unknown_flags_are_the_subcommands_with_close_matches(capsys):
    code, out = run_cli(capsys, "serve", "--max-num-seq", "4")
    assert code == 2 and "ferry serve: error: unrecognized argument: --max-num-seq" in out
    assert "did you mean --max-num-seqs" in out
    code, out = run_cli(capsys, "bench", "soak", "--duraton", "3")
    assert code == 2 and "ferry bench soak: error" in out and "--duration" in out
    code, out = run_cli(capsys, "serve", "--enable-prefix-cachin")  # no abbreviations
    assert code == 2 and "did you mean --enable-prefix-caching" in out


def test_a_vllm_launch_line_starts_ferry_serve(tmp_path):
    model = make_tiny_served_model(tmp_path / "model")
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    port = free_port()
    command = [
        sys.executable, "-m", "ferry", "serve", str(model), "--port", str(port), "--tensor-parallel-size", "1",
        "--disable-log-requests", "--trust-remote-code", "--tokenizer", str(model), "--chat-template", str(template),
        "--kv-cache-dtype", "auto", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--uvicorn-log-level", "warning", "--enable-chunked-prefill", "--generation-config", "auto",
        "--swap-space", "4", "--disable-log-stats", "--max-model-len", "256", "--served-model-name", "tiny",
    ]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 256
        tokens = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "add_special_tokens": False}).json()["tokens"]
        text = httpx.post(url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert text == "<<hi>>"  # the --chat-template, not the model's ChatML
        reply = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_a_tokenizer_folder_without_a_tokenizer_is_an_error(capsys, tmp_path):
    code, out = run_cli(capsys, "serve", "--tokenizer", str(tmp_path))
    assert code == 2 and "--tokenizer" in out and "no tokenizer.json" in out


def test_the_model_given_twice_must_agree(capsys, tmp_path):
    code, out = run_cli(capsys, "serve", str(tmp_path / "a"), "--model", str(tmp_path / "b"))
    assert code == 2 and "the model is given twice" in out


def test_generation_config_sources(tmp_path):
    from ferry.config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (2, 3)
    assert ModelConfig.from_pretrained(tmp_path, generation_config="vllm").eos_token_ids == (1,)
    assert ModelConfig.from_pretrained(tmp_path, generation_config=str(other)).eos_token_ids == (7,)
    with pytest.raises(ValueError, match="generation_config"):
        ModelConfig.from_pretrained(tmp_path, generation_config=str(tmp_path / "none"))
