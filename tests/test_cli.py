"""The `asyncengine` command line: its subcommands, vLLM's spellings of `serve`'s flags, and what the front-end
flags turn into (sampling defaults from a generation config, the chat template, the logprobs cap). The servers
these flags configure are tested in test_server_cli.py."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncengine.api.cli import build_parser, engine_config, main, serving_options, with_default_command
from asyncengine.api.errors import APIError
from asyncengine.api.inputs import EnginePrompt, SamplingPolicy
from asyncengine.tokenizer import load_tokenizer, resolve_chat_template

# vLLM flags that take a value, with a value each: none may be taken for the positional model.
VALUE_FLAGS = {
    "--gpu-memory-utilization": "0.9", "--tokenizer": "/tok", "--chat-template": "{{ x }}",
    "--generation-config": "vllm", "--max-logprobs": "5", "--allowed-origins": '["*"]', "--ssl-keyfile": "k.pem",
    "--ssl-certfile": "c.pem", "--root-path": "/api", "--uvicorn-log-level": "debug", "--max-model-len": "64",
    "--dtype": "float32", "--port": "0", "--served-model-name": "m",
}


def parse(*argv: str):
    return build_parser().parse_args(with_default_command(argv))


@pytest.mark.parametrize("flag", sorted(VALUE_FLAGS))
def test_a_flags_value_is_never_the_model(flag):
    args = parse("serve", flag, VALUE_FLAGS[flag])
    assert args.model is None and args.model_option is None
    args = parse("serve", "/models/llama", flag, VALUE_FLAGS[flag])  # (--served-model-name takes 1+ values)
    assert args.model == "/models/llama"


def test_every_vllm_flag_reaches_its_setting(tmp_path):
    args = parse("serve", "--model", "/m", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--tokenizer",
                 "/tok", "--uvicorn-log-level", "debug", "--allowed-origins", '["https://a.example"]',
                 "--root-path", "/api", "--disable-log-requests", "--max-logprobs", "3")
    config = engine_config(args)
    assert (config.model, config.tokenizer, config.gpu_memory_utilization, config.enforce_eager) == \
        ("/m", "/tok", 0.5, True)
    assert args.log_level == "debug" and args.allowed_origins == ["https://a.example"] and args.root_path == "/api"
    assert args.log_requests is False and parse("serve", "--enable-log-requests").log_requests is True
    assert serving_options(args, str(tmp_path)).policy.max_logprobs == 3
    for name in ("awq", "gptq_marlin", "awq_marlin", "fp8"):  # vLLM's Marlin names are accepted too
        assert engine_config(parse("serve", "/m", "--quantization", name)).quantization == name


def test_the_model_positional_or_by_flag_but_not_two_different_ones():
    assert engine_config(parse("serve", "/m")).model == engine_config(parse("serve", "--model", "/m")).model == "/m"
    assert engine_config(parse("serve", "/m", "--model", "/m")).model == "/m"
    with pytest.raises(ValueError, match="model given twice"):
        engine_config(parse("serve", "/a", "--model", "/b"))


@pytest.mark.parametrize("argv, fragment", [
    (["serve", "--allowed-origins", "*"], "JSON list"),
    (["serve", "--gpu-memory-utilization", "lots"], "invalid float"),
    (["serve", "--uvicorn-log-level", "loud"], "invalid choice"),
    (["serve", "--quantization", "marlin"], "invalid choice"),
    (["serve", "--enable-log-requests", "--disable-log-requests"], "not allowed with"),
])
def test_bad_flags_are_usage_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and fragment in capsys.readouterr().err


def test_tls_flags_must_come_as_a_pair(tmp_path, capsys):
    """Checked before anything loads: hypercorn would only fail once serving."""
    assert main(["serve", "--ssl-keyfile", str(tmp_path / "key.pem")]) == 2
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err
    (tmp_path / "key.pem").write_text("not a key")
    (tmp_path / "cert.pem").write_text("not a certificate")
    assert main(["serve", "--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile",
                 str(tmp_path / "cert.pem")]) == 2
    assert "cannot load them" in capsys.readouterr().err


def test_no_subcommand_is_the_demo():
    assert with_default_command([]) == ["generate"]
    assert with_default_command(["--prompt", "Hi"]) == ["generate", "--prompt", "Hi"]
    assert with_default_command(["--help"]) == ["--help"]
    assert with_default_command(["--version"]) == ["--version"]
    assert parse("--prompt", "Hi", "--max-tokens", "3").command == "generate"


def test_version(capsys):
    import asyncengine

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"asyncengine {asyncengine.__version__}\n"


def test_generate_prints_each_continuation(capsys):
    assert main(["--prompt", "ROMEO:", "--max-tokens", "4", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- 'ROMEO:'\nROMEO:") and "[1 prompts, 4 tokens in" in out


def test_serve_help_is_the_same_from_the_console_script_and_python_m():
    exe = shutil.which("asyncengine")
    assert exe is not None, "the asyncengine console script is not installed (pip install -e .)"
    by_module = subprocess.run([sys.executable, "-m", "asyncengine", "serve", "--help"], capture_output=True,
                               text=True, timeout=120)
    by_script = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert by_module.returncode == by_script.returncode == 0, by_module.stderr + by_script.stderr
    assert by_module.stdout == by_script.stdout
    assert by_module.stdout.startswith("usage: asyncengine serve")
    for flag in ("--model", "--gpu-memory-utilization", "--enforce-eager", "--tokenizer", "--chat-template",
                 "--generation-config", "--max-logprobs", "--allowed-origins", "--ssl-keyfile", "--ssl-certfile",
                 "--root-path", "--disable-log-requests", "--uvicorn-log-level", "--api-key", "--served-model-name",
                 "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--max-queue-len", "--shutdown-timeout",
                 "--no-enable-prefix-caching", "--engine-process", "--timeout-keep-alive"):
        assert flag in by_module.stdout, flag


def test_bench_serve_without_its_extra_says_so_in_one_line(monkeypatch, capsys):
    """aiohttp made unimportable, as on an install without the 'bench' extra: one line naming the extra."""
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    assert main(["bench", "serve", "--num-prompts", "2"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "asyncengine bench serve: error: needs the 'bench' extra (aiohttp is not installed): "
        "pip install 'asyncengine[bench]'"]


def test_bench_serve_runs_the_installed_load_generator(capsys):
    """`asyncengine bench serve` against the load generator's fake OpenAI server: the package's own copy
    (asyncengine.loadtest) measures and reports."""
    import asyncio

    from test_loadtest import FakeOpenAI, serving

    async def scenario():
        async with serving(FakeOpenAI(first_token_s=0.02, token_s=0.005)) as url:
            argv = ["bench", "serve", "--base-url", url, "--num-prompts", "4", "--input-len", "20", "--output-len",
                    "5", "--no-progress"]
            return await asyncio.to_thread(main, argv)  # the CLI runs its own loop, in a thread

    assert asyncio.run(scenario()) == 0
    assert "4 completed, 0 failed" in capsys.readouterr().out
    assert "asyncengine.loadtest.runner" in sys.modules


def test_bench_serve_is_the_load_generator(capsys):
    """The same parser as `python -m loadtest`: its own validation reaches the user as a usage error."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--num-prompts", "2", "--workers", "3"])
    assert exit_info.value.code == 2 and "workers must be in [1, num_prompts]" in capsys.readouterr().err


# -- --generation-config ---------------------------------------------------------------------------------------
def write_generation_config(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1, **fields}))
    return folder


def test_generation_config_auto_reads_the_models_defaults(tmp_path):
    model = write_generation_config(tmp_path / "model", do_sample=True, temperature=0.6, top_p=0.9, top_k=50,
                                    repetition_penalty=1.1, max_new_tokens=33)
    policy = SamplingPolicy.from_generation_config("auto", str(model))
    assert policy.defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1,
                               "max_tokens": 33}
    assert policy.value("temperature", None, 1.0) == 0.6 and policy.value("temperature", 0.2, 1.0) == 0.2
    assert policy.value("min_p", None, 0.0) == 0.0


def test_generation_config_vllm_ignores_it_and_a_folder_replaces_it(tmp_path):
    model = write_generation_config(tmp_path / "model", do_sample=True, temperature=0.6)
    other = write_generation_config(tmp_path / "other", do_sample=True, top_k=7)
    assert SamplingPolicy.from_generation_config("vllm", str(model)).defaults == {}
    assert SamplingPolicy.from_generation_config(str(other), str(model)).defaults == {"top_k": 7}
    assert SamplingPolicy.from_generation_config("auto", str(tmp_path)).defaults == {}  # a model without one
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        SamplingPolicy.from_generation_config(str(tmp_path / "missing"), str(model))
    bad = write_generation_config(tmp_path / "bad", do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="generation_config: the defaults .* top_p"):
        SamplingPolicy.from_generation_config(str(bad), str(model))


def test_a_default_max_tokens_is_cut_to_the_room_the_prompt_leaves():
    policy = SamplingPolicy(defaults={"max_tokens": 100})
    assert policy.default_max_tokens([EnginePrompt([1] * 10, None)], max_model_len=64) == 54
    assert policy.default_max_tokens([EnginePrompt([1] * 10, None)], max_model_len=512) == 100
    assert policy.default_max_tokens([EnginePrompt([1] * 64, None)], max_model_len=64) is None
    assert SamplingPolicy().default_max_tokens([EnginePrompt([1], None)], max_model_len=64) is None


def test_max_logprobs_caps_requests_with_a_400_naming_the_field():
    policy = SamplingPolicy(max_logprobs=2)
    policy.check_logprobs(2, "logprobs")
    with pytest.raises(APIError) as error:
        policy.check_logprobs(3, "top_logprobs")
    assert error.value.status == 400 and error.value.param == "top_logprobs" and "at most 2" in error.value.message
    with pytest.raises(ValueError, match=r"max_logprobs must be in \[0, 20\] or -1"):
        SamplingPolicy(max_logprobs=21)
    assert SamplingPolicy(max_logprobs=-1).max_logprobs == 20  # vLLM's "no cap": the engine's limit


# -- --chat-template -------------------------------------------------------------------------------------------
def test_chat_template_from_a_file_or_inline(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert resolve_chat_template(str(path)) == path.read_text()
    assert resolve_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        resolve_chat_template(str(tmp_path / "mistyped.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        resolve_chat_template("{% for m in messages %}")


# -- the tokenizer's own length limit ----------------------------------------------------------------------------
class _RecordedMessages(logging.Handler):
    """Every message logged under a logger while attached: transformers' library logger does not propagate to the
    root (caplog misses it), and its stream handler may hold a stderr from before capfd took over (transformers
    5.23: the warning reached pytest's report but not capfd)."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_too_long_prompt_is_rejected_without_transformers_indexing_warning(llama_dir, capfd):
    """The engine rejects a prompt over max_model_len itself; transformers must not also warn that running it
    "will result in indexing errors" (the tokenizer's model_max_length, shown to do so without the fix)."""
    from transformers import AutoTokenizer

    from asyncengine import LLM, SamplingParams

    recorded = _RecordedMessages()
    logging.getLogger("transformers").addHandler(recorded)
    try:
        long_text = "hello world " * 400  # ~800 tokens, over the checkpoint's 512 positions
        plain = AutoTokenizer.from_pretrained(str(llama_dir), local_files_only=True)
        plain.model_max_length = 512
        plain(long_text)
        seen = " ".join(recorded.messages) + capfd.readouterr().err
        assert "indexing errors" in seen  # the warning this test guards against
        recorded.messages.clear()

        assert len(load_tokenizer(str(llama_dir))(long_text).input_ids) > 512
        llm = LLM(str(llama_dir), max_model_len=512, num_kv_blocks=64)
        with pytest.raises(ValueError, match="512"):
            llm.generate([long_text], SamplingParams(max_tokens=4), use_tqdm=False)
        assert "indexing errors" not in " ".join(recorded.messages) + capfd.readouterr().err
    finally:
        logging.getLogger("transformers").removeHandler(recorded)
