"""``python -m stepops plan``: a checkpoint's config.json read as the loaders read it, and the cache pages the
allocator gives its model, printed. The numbers are worked out by hand in the comments; that they are the
allocator's own is tests/test_allocator.py's ``test_the_plan_is_what_the_allocator_gives...``."""

import json
import re
from pathlib import Path

import pytest
from inkling_oracle_helpers import HF_CONFIG
from test_step5_weights import reference_config, released_config
from transformers import InklingTextConfig

from stepops.cli import main


def _rows(output: str) -> dict[str, str]:
    """The printed rows other than the layer groups, by label."""
    rows = re.findall(r"^  (\S.*?)\s{2,}(\S.*)$", output, re.MULTILINE)
    return {label: value for label, value in rows if not label.startswith("layers.")}


def _groups(output: str) -> list[tuple[str, str]]:
    """The layer-group rows in order (labels repeat: one per unified spec)."""
    return re.findall(r"^  (layers\.\S+ x \d+)\s+(\S.*)$", output, re.MULTILINE)


@pytest.fixture
def step5_checkpoint(tmp_path):
    # Layer 0 sliding (window 24), layer 1 CSA, and the MTP layer: 2 KV heads of 48 + 48, bf16.
    config = reference_config(["sliding_attention", "full_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_step5_plan(step5_checkpoint, capsys):
    assert main(["plan", "step5", str(step5_checkpoint), "--memory-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"step5 caches of {step5_checkpoint / 'config.json'} (2 layers, one rank)\n")
    # 2 x (48 + 48) x 2 B = 384 B per token; 7 + k = 10 rows of 1024 B need 27 tokens: block size 32, a
    # 12288 B page (12 rows), which every cache layer's block takes, the ring's too (1 head of 12288 / 64).
    assert _groups(out) == [
        ("layers.*.attn x 1", "window 24: block size 32, 2 KV head(s) x (48 + 48) bfloat16"),
        ("layers.*.attn x 1", "full: block size 32, 2 KV head(s) x (48 + 48) bfloat16"),
        ("layers.*.csa_ring x 1", "ring: block size 32, 1 KV head(s) x (192 + 0) bfloat16"),
    ]
    rows = _rows(out)
    assert rows["page (block stride)"] == "12288 B per block id in each cache layer"
    assert rows["per block id"] == "36864 B (3 cache layers)"  # 3 x 12288
    assert rows["smallest block size"] == "32 tokens"
    assert rows["summary caches"] == "1 CSA layer(s) x 4096 B per summary block (e4m3, not paged)"  # 16 x 256
    assert rows["blocks in 1 GiB"] == f"{2**30 // 36864}"


def test_step5_plan_sizes_the_ring_for_the_speculative_tokens(step5_checkpoint, capsys):
    # k = 12: 19 rows need 50 tokens at 384 B: block size 64, a 24576 B page.
    assert main(["plan", "step5", str(step5_checkpoint / "config.json"), "--num-speculative-tokens", "12"]) == 0
    assert _rows(capsys.readouterr().out)["page (block stride)"] == "24576 B per block id in each cache layer"


def test_inkling_plan(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(InklingTextConfig(**HF_CONFIG).to_dict()))
    assert main(["plan", "inkling", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # Sliding layers 0, 2: 1 KV head of 8 + 8 (32 B per token); their conv state: head_dim 8, hidden 64 per head,
    # D = next_pow2(2*8 + 2*64) = 256, kernel 4: 4 x 256 x 2 = 2048 B. Global layer 1: 2 heads of 16 + 16, 16
    # tokens = 2048 B; conv D = next_pow2(2*16 + 2*32) = 128 over 2 heads: 2048 B. So the page is 2048 B and the
    # sliding attention's block grows to 2048 / 32 = 64 tokens.
    assert _groups(out) == [
        ("layers.*.attn x 2", "window 8: block size 64, 1 KV head(s) x (8 + 8) bfloat16"),
        ("layers.*.conv_state x 2", "window 4: block size 4, 1 KV head(s) x (256 + 0) bfloat16"),
        ("layers.*.attn x 1", "full: block size 16, 2 KV head(s) x (16 + 16) bfloat16"),
        ("layers.*.conv_state x 1", "window 4: block size 4, 2 KV head(s) x (128 + 0) bfloat16"),
    ]
    rows = _rows(out)
    assert rows["page (block stride)"] == "2048 B per block id in each cache layer"
    assert rows["per block id"] == "12288 B (6 cache layers)"
    assert rows["smallest block size"] == "4 tokens"
    assert "summary caches" not in rows and "blocks in" not in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["inkling", "{dir}/missing"], "{dir}/missing: no config.json (give a checkpoint directory or its"),
        (["inkling", "{dir}/llama.json"], "{dir}/llama.json: expected an Inkling checkpoint"),
        (["step5", "{dir}/llama.json"], "{dir}/llama.json: the Step5 config has no 'num_hidden_layers'"),
        (["inkling", "{dir}/broken.json"], "{dir}/broken.json: not valid JSON"),
        (["step5", "{dir}/latin1.json"], "{dir}/latin1.json: not valid JSON ('utf-8' codec can't decode byte 0xe9"),
        (["step5", "{dir}/llama.json", "--num-speculative-tokens", "-1"], "--num-speculative-tokens must be >= 0"),
        (["step5", "{dir}/llama.json", "--memory-gib", "0"], "--memory-gib must be a finite number > 0, got 0.0"),
        (["step5", "{dir}/llama.json", "--memory-gib", "inf"], "--memory-gib must be a finite number > 0, got inf"),
        (["step5", "{dir}/llama.json", "--memory-gib", "nan"], "--memory-gib must be a finite number > 0, got nan"),
    ],
)
def test_plan_errors_are_one_line(tmp_path, capsys, args, message):
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "latin1.json").write_bytes('{"name": "\u00e9"}'.encode("latin-1"))  # a UnicodeDecodeError before
    assert main(["plan", *(a.format(dir=tmp_path) for a in args)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(message.format(dir=tmp_path)) and captured.err.count("\n") == 1, captured.err


def test_the_docs_plan_of_the_released_step5_is_the_cli_output(tmp_path, capsys):
    """docs/caches.md shows the plan of the released model's config.json: it is what the CLI prints."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "caches.md").read_text()
    example = re.search(r"```\n\$ python -m stepops (plan step5 \S+ --memory-gib 60).*?\n(.*?)```", docs, re.S)
    command, shown = example.groups()
    (tmp_path / "config.json").write_text(json.dumps(released_config()))
    assert main([*command.replace("path/to/step5", str(tmp_path)).split()]) == 0
    assert capsys.readouterr().out == shown.replace("path/to/step5", str(tmp_path))
