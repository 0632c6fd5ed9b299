"""The `specjax` command: help without JAX, generate (token for token what LLM.generate gives), chat through
stdin, bench's JSON and plot, convert and train delegated, user mistakes as one line and exit status 1."""
from __future__ import annotations

import io
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints_conv import is_orbax_checkpoint
from specjax import cli

ROOT = Path(__file__).resolve().parents[1]
GREEDY = ["--temperature", "0"]


def test_help_loads_no_jax():
    """cli.py on its own (outside the package, whose __init__ imports the engine) answers every --help
    with the standard library alone."""
    script = (f"import importlib.util, sys\n"
              f"spec = importlib.util.spec_from_file_location('cli', {str(ROOT / 'specjax/cli.py')!r})\n"
              "cli = importlib.util.module_from_spec(spec); spec.loader.exec_module(cli)\n"
              "for argv in ([], ['generate'], ['chat'], ['bench']):\n"
              "    try:\n"
              "        cli.main(argv + ['--help'])\n"
              "    except SystemExit as stop:\n"
              "        assert stop.code == 0, argv\n"
              "assert 'jax' not in sys.modules, 'jax was imported'\n")
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for command in ("generate", "chat", "bench", "convert", "train", "--num-speculative-tokens",
                    "--speculative-config", "--output-json"):
        assert command in result.stdout


def test_console_script_and_module_answer_help(monkeypatch, capsys):
    script = Path(sys.executable).parent / "specjax"
    top = subprocess.run([str(script), "--help"], check=False, capture_output=True, text=True)
    assert top.returncode == 0 and all(c in top.stdout for c in ("generate", "chat", "bench", "convert", "train"))
    monkeypatch.setattr(sys, "argv", ["python -m specjax", "train", "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_module("specjax", run_name="__main__")
    assert stop.value.code == 0 and "--num-train" in capsys.readouterr().out


@pytest.mark.parametrize("command, expected", [("convert", "hf-to-orbax"), ("train", "--init-head"),
                                               ("generate", "--prompt-lookup-max"), ("chat", "/reset"),
                                               ("bench", "--num-iters-warmup")])
def test_each_command_has_help(command, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    assert stop.value.code == 0 and expected in capsys.readouterr().out


def test_prompts_from_arguments_text_files_and_json_lines(tmp_path, monkeypatch):
    text = tmp_path / "prompts.txt"
    text.write_text("first line\n\n{\"prompt_token_ids\": [1, 2]}\n{\"messages\": [{\"role\": \"user\", "
                    "\"content\": \"hi\"}]}\n")
    records = cli.read_prompts(["an argument"], str(text), chat=True)
    assert records == [{"messages": [{"role": "user", "content": "an argument"}]},
                       {"messages": [{"role": "user", "content": "first line"}]},
                       {"prompt_token_ids": [1, 2]}, {"messages": [{"role": "user", "content": "hi"}]}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\n"))
    assert cli.read_prompts([], None, chat=False) == [{"prompt": "from stdin"}]
    text.write_text("ok\n{\"prompt\": \n")
    with pytest.raises(ValueError, match=r"prompts.txt:2: not valid JSON"):
        cli.read_prompts([], str(text), chat=False)
    text.write_text("{\"text\": \"x\"}\n")
    with pytest.raises(ValueError, match="needs 'prompt', 'prompt_token_ids' or 'messages'"):
        cli.read_prompts([], str(text), chat=False)


def test_speculative_flags_override_the_json():
    args = cli.build_parser().parse_args(
        ["generate", "x", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}',
         "--num-speculative-tokens", "3", "--prompt-lookup-max", "4"])
    assert cli.speculative_config(args) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert cli.speculative_config(cli.build_parser().parse_args(["generate", "x"])) is None
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "x", "--speculative-config", "[1]"])


def test_user_mistakes_end_with_one_line_and_status_1(tmp_path, capsys):
    assert cli.main(["generate", "--input", str(tmp_path / "missing.txt")]) == 1
    assert cli.main(["generate", "x", "--method", "ngram", "--num-speculative-tokens", "0"]) == 1
    assert cli.main(["convert", "hf-to-orbax", str(tmp_path / "no_such_dir"), str(tmp_path / "out")]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[0] for line in errors if line.startswith("error")] == ["error"] * 3
    assert "missing.txt" in errors[0] and "num_speculative_tokens" in "\n".join(errors)


def test_generate_writes_what_llm_generate_returns(tiny_chat_model, tmp_path, monkeypatch):
    from specjax import LLM, SamplingParams

    out = tmp_path / "out.jsonl"
    conversation = [{"role": "user", "content": "Name a colour."}]
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({"prompt_token_ids": [1, 504, 3575]}) + "\n"
                                                  + json.dumps({"messages": conversation}) + "\n"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    assert cli.main(["generate", "The capital of France is", "--model", str(tiny_chat_model), "--input", "-",
                     "--output", str(out), "--max-tokens", "6", "--max-model-len", "256", "--max-num-seqs", "2",
                     *GREEDY, "--speculative-config", json.dumps(spec)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    llm = LLM(str(tiny_chat_model), max_model_len=256, max_num_seqs=2, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = llm.generate(["The capital of France is", {"prompt_token_ids": [1, 504, 3575]}], params) + \
        llm.chat([conversation], params)
    assert [r["request_id"] for r in records] == ["0", "1", "2"]
    for record, output in zip(records, expected):
        completion, want = record["outputs"][0], output.outputs[0]
        assert record["prompt_token_ids"] == output.prompt_token_ids
        assert completion["token_ids"] == want.token_ids and completion["text"] == want.text
        assert completion["finish_reason"] == want.finish_reason
        assert completion["num_drafts"] == want.num_drafts
        assert completion["mean_acceptance_length"] == want.mean_acceptance_length


def test_chat_keeps_the_conversation_and_resets(tiny_chat_model, monkeypatch, capsys):
    seen, replies = [], []
    real_reply = cli.reply

    def recording_reply(llm, conversation, params):
        seen.append([turn["content"] for turn in conversation])
        replies.append(real_reply(llm, conversation, params))
        return replies[-1]

    monkeypatch.setattr(cli, "reply", recording_reply)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2+2?\n\nAnd times 3?\n/reset\nHi\n/exit\nnever read\n"))
    assert cli.main(["chat", "--model", str(tiny_chat_model), "--system", "Be brief.", "--max-tokens", "4",
                     "--max-model-len", "256", *GREEDY]) == 0
    assert seen == [["Be brief.", "What is 2+2?"], ["Be brief.", "What is 2+2?", replies[0], "And times 3?"],
                    ["Be brief.", "Hi"]]
    assert capsys.readouterr().out == "".join(text.strip() + "\n" for text in replies)


def test_chat_prints_a_reply_as_it_comes_trimmed_as_a_whole(capsys):
    printer, shown = cli.TrimmedPrinter(), []
    for piece in ["\n ", "Hello", " ", "", "wor", "ld", " \n", "\n"]:
        printer.write(piece)
        shown.append(capsys.readouterr().out)
    printer.end()
    assert shown == ["", "Hello", "", "", " wor", "ld", "", ""] and capsys.readouterr().out == "\n"


def test_bench_latency_and_throughput(tiny_chat_model, tmp_path, capsys):
    common = ["--model", str(tiny_chat_model), "--input-len", "8", "--output-len", "8", "--num-iters-warmup", "1",
              "--num-iters", "2", "--max-model-len", "128", *GREEDY, "--method", "ngram",
              "--prompt-lookup-min", "1", "--prompt-lookup-max", "2"]
    report, plot = tmp_path / "latency.json", tmp_path / "speedup.png"
    assert cli.main(["bench", "latency", *common, "--batch-size", "1", "2", "--num-speculative-tokens", "0", "2",
                     "--output-json", str(report), "--plot", str(plot)]) == 0
    results = json.loads(report.read_text())["results"]
    assert [(r["k"], r["batch_size"]) for r in results] == [(0, 1), (0, 2), (2, 1), (2, 2)]
    for r in results:
        assert len(r["latencies"]) == 2 and r["output_tokens"] == 8 * r["batch_size"]
        assert r["percentiles"]["10"] <= r["percentiles"]["50"] <= r["percentiles"]["99"]
        assert r["speedup"] == pytest.approx(results[0 if r["batch_size"] == 1 else 1]["median_latency"]
                                             / r["median_latency"])
    assert [r["mean_acceptance_length"] is None for r in results] == [True, True, False, False]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    throughput, questions = tmp_path / "throughput.json", tmp_path / "questions.txt"
    questions.write_text("What is 2+2?\nName a colour.\n")   # cycled to --num-prompts
    assert cli.main(["bench", "throughput", *common, "--batch-size", "2", "--num-speculative-tokens", "2",
                     "--num-prompts", "3", "--input", str(questions), "--chat",
                     "--output-json", str(throughput)]) == 0
    (cell,) = json.loads(throughput.read_text())["results"]
    assert cell["output_tokens"] == 3 * 8 and cell["speedup"] is None
    assert cell["requests_per_second"] == pytest.approx(3 / cell["median_latency"])
    table = capsys.readouterr().out.splitlines()
    assert "tokens/s" in table[-2] and table[-1].split()[:2] == ["2", "2"]


def test_bench_plot_needs_the_plain_baseline(capsys):
    assert cli.main(["bench", "latency", "--num-speculative-tokens", "2", "--plot", "x.png"]) == 1
    assert "include 0" in capsys.readouterr().err


def test_convert_delegates_to_the_converter(tiny_checkpoint_factory, tmp_path):
    out = tmp_path / "orbax"
    assert cli.main(["convert", "hf-to-orbax", str(tiny_checkpoint_factory("llama")), str(out)]) == 0
    assert is_orbax_checkpoint(out)


def test_train_delegates_to_the_training_pipeline(tiny_chat_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count to {n}."}) + "\n" for n in range(6)))
    head, work = tmp_path / "head", tmp_path / "work"
    assert cli.main(["train", "--target", str(tiny_chat_model), "--prompts", str(prompts), "--out", str(head),
                     "--work", str(work), "--num-train", "4", "--num-heldout", "2", "--num-eval", "1",
                     "--max-new-tokens", "6", "--max-model-len", "128", "--generate-batch", "4",
                     "--draft-vocab-size", "64", "--steps", "2", "--log-every", "1",
                     "--tokens-per-batch", "512"]) == 0
    assert json.loads((head / "config.json").read_text())["draft_vocab_size"] == 64
    assert [json.loads(line)["stage"] for line in (work / "log.jsonl").read_text().splitlines()] == \
        ["data", "train", "train", "eval"]
