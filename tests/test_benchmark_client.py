"""A maintained third-party benchmark client against `specgate up`, as serving engineers point
one at a new endpoint: NVIDIA's aiperf (installed by `make tools` in an environment of its own),
streaming chat and plain completions, with no network (a word-level tokenizer made here stands
in for a hub tokenizer; the simulated pods answer whatever the prompt)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .tools import TOOLS, specgate_up, tool, wait_until_answers

pytestmark = pytest.mark.integration

REQUESTS = 24
OUTPUT_TOKENS = 16

MAKE_TOKENIZER = """
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

words = ["[UNK]", "[BOS]", "[EOS]", *"the a of and to in is it you that was for on".split()]
vocab = {w: i for i, w in enumerate(words)}
tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer.decoder = decoders.WordPiece()
PreTrainedTokenizerFast(
    tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]"
).save_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    python = TOOLS / "aiperf" / "bin" / "python"
    done = subprocess.run([str(python), "-c", MAKE_TOKENIZER, str(folder)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture(scope="module")
def stack() -> Iterator[str]:
    with specgate_up() as url:
        wait_until_answers(url + "/readyz")
        yield url


@pytest.mark.parametrize(
    ("endpoint", "streaming"),
    [("chat", True), ("completions", False)],
    ids=["chat-stream", "completions"],
)
def test_aiperf_completes_a_profile_through_the_router_without_errors(
    stack: str, tokenizer: Path, tmp_path: Path, endpoint: str, streaming: bool
) -> None:
    args = [
        tool("aiperf"), "profile", "--model", "sim-model", "--url", stack,
        "--endpoint-type", endpoint, "--tokenizer", str(tokenizer),
        "--request-count", str(REQUESTS), "--concurrency", "4",
        "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", str(OUTPUT_TOKENS),
        "--extra-inputs", "ignore_eos:true",
        "--output-artifact-dir", str(tmp_path), "--ui-type", "none",
        *(["--streaming"] if streaming else []),
    ]  # fmt: skip
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert report["is_complete"] is True and report["was_cancelled"] is False
    assert report["error_summary"] == []
    assert report["request_count"]["avg"] == REQUESTS
    assert report["output_sequence_length"]["avg"] == OUTPUT_TOKENS
    if streaming:  # tokens arrived as a stream: a first token before the last
        assert report["time_to_first_token"]["avg"] < report["request_latency"]["avg"]
