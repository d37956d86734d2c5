"""``python -m stepops layout``: printed layouts, exit status and the exact error text.

Three runs go through a subprocess (the real entry point, from outside the checkout); the rest call
``stepops.cli.main`` in-process, since each interpreter start pays for importing torch and triton.
Expected numbers are worked out by hand in comments.
"""

import re
import subprocess
import sys

import pytest

from stepops.cli import main


def _run(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "stepops", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def _row(output: str, label: str) -> str:
    match = re.search(rf"^  {re.escape(label)}\s+(.*)$", output, re.MULTILINE)
    assert match, f"no row {label!r} in:\n{output}"
    return match.group(1)


def test_layout_without_a_model_prints_both_defaults(tmp_path):
    result = _run("layout", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    assert "Step5 CSA tail ring" in out and "Inkling short-conv state" in out
    # Step5 default: 64 tokens x 1 head x 576 x 2 B = 73728 B = 72 rows; k = 3 needs 10 rows, and
    # 16 tokens (18432 B = 18 rows) is the first multiple of 16 that holds them.
    assert _row(out, "KV page") == "73728 B"
    assert _row(out, "required rows (7 + k)") == "10 of 1024 B"
    assert _row(out, "ring capacity").startswith("72 rows")
    assert _row(out, "rows_per_block").startswith("72 unpadded")
    assert _row(out, "ring spec head_size").startswith("576 ")
    assert _row(out, "smallest block size").startswith("16 (page 18432 B, capacity 18 rows)")
    # Inkling default: 8 heads of 128, hidden 4096 -> 512 per head; 2*128 + 2*512 = 1280 -> D = 2048.
    assert _row(out, "KV heads per rank (H)").startswith("8 ")
    assert _row(out, "D (head_size)").startswith("2048 ")
    assert _row(out, "stream K") == "[0, 128) width 128"
    assert _row(out, "stream V") == "[128, 256) width 128"
    assert _row(out, "stream ATTN_OUT") == "[256, 768) width 512"
    assert _row(out, "stream MLP_OUT") == "[768, 1280) width 512"
    assert _row(out, "cache shape (HND)") == "[num_blocks, 8, 4, 2048] bfloat16"
    assert _row(out, "page bytes") == "131072 per block"  # 8 * 4 * 2048 * 2


def test_step5_page_too_small_exits_with_the_seed_message(tmp_path):
    # 16 tokens x 1152 B = 18432 B = 18 rows; k = 12 needs 19.
    result = _run("layout", "step5", "--block-size", "16", "--num-speculative-tokens", "12", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    first, second = result.stderr.splitlines()
    assert first == "Step5 CSA tail ring needs 19 rows of 1024 bytes in one 18432-byte KV page; increase --block-size."
    # 1152 B per token: 16 tokens hold 18 rows, 32 tokens 36 (>= 19, whole rows).
    assert second == "smallest block size that fits at 1152 B per token: 32 (page 36864 B, capacity 36 rows)"


def test_inkling_tp_above_heads_exits_with_the_message(tmp_path):
    result = _run("layout", "inkling", "--tp-size", "16", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == "sconv SWA cache supports tp_size <= num_kv_heads (8), got 16\n"


def test_step5_with_main_layer_heads(capsys):
    # 16 tokens x 8 heads x (128 + 128) x 2 B = 65536 B = 64 rows; 16 is the smallest candidate.
    status = main(
        ["layout", "step5", "--block-size", "16", "--num-kv-heads", "8", "--head-size", "128",
         "--head-size-v", "128", "--num-speculative-tokens", "2"]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert _row(out, "KV page") == "65536 B"
    assert _row(out, "ring capacity").startswith("64 rows")
    assert _row(out, "ring spec head_size").startswith("2048 ")  # 65536 / (16 * 2)
    assert _row(out, "required rows (7 + k)") == "9 of 1024 B"


def test_step5_fp8_main_layer_and_smallest_block_size(capsys):
    # fp8: 576 B per token; at 64 tokens 36 rows. k = 3 needs 10 rows = 10240 B -> 17.8 tokens -> 32
    # (16 tokens = 9216 B is not a whole number of rows).
    assert main(["layout", "step5", "--dtype", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "KV page") == "36864 B"
    assert _row(out, "smallest block size").startswith("32 (page 18432 B, capacity 18 rows)")


def test_step5_page_bytes_option(capsys):
    assert main(["layout", "step5", "--page-bytes", "16384", "--block-size", "32", "--num-speculative-tokens", "9"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "ring capacity").startswith("16 rows")
    assert _row(out, "ring spec head_size").startswith("256 ")  # 16384 / (32 * 2)
    # 512 B per token: 16 rows needed -> 16384 B -> 32 tokens.
    assert _row(out, "smallest block size").startswith("32 ")


def test_step5_partial_rows_exit_with_the_seed_message(capsys):
    assert main(["layout", "step5", "--page-bytes", "10752", "--block-size", "16"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    first, second = captured.err.splitlines()
    assert first == "Step5 CSA tail ring needs 10 rows of 1024 bytes in one 10752-byte KV page; increase --block-size."
    # 10752 / 16 = 672 B per token = 21 * 32: whole 1024-byte rows only at multiples of 32 tokens (21 rows).
    assert second == "smallest block size that fits at 672 B per token: 32 (page 21504 B, capacity 21 rows)"


def test_step5_no_block_size_fits(capsys):
    # 10000 / 16 = 625 B per token, an odd number of bytes: no block size splits the page into whole bf16
    # elements per token (the ring spec's head_size), so no candidate fits.
    assert main(["layout", "step5", "--page-bytes", "10000", "--block-size", "16"]) == 1
    first, second = capsys.readouterr().err.splitlines()
    assert first == "Step5 CSA tail ring needs 10 rows of 1024 bytes in one 10000-byte KV page; increase --block-size."
    assert second == "smallest block size that fits at 625 B per token: none among multiples of 16 up to 4096"


def test_inkling_tensor_parallel_and_enlarged_block(capsys):
    # tp 2: 4 heads per rank; D stays 2048; page = 4 * 32 * 2048 * 2.
    assert main(["layout", "inkling", "--tp-size", "2", "--block-size", "32"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "KV heads per rank (H)").startswith("4 (8 / tp_size 2)")
    assert _row(out, "cache shape (HND)") == "[num_blocks, 4, 32, 2048] bfloat16"
    assert _row(out, "page bytes") == "524288 per block"
    assert _row(out, "block size (N)") == "32 (kernel size 4)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hidden-size", "4100"], "sconv SWA cache needs hidden_size (4100) divisible by num_kv_heads (8)"),
        (["--tp-size", "3"], "sconv SWA cache needs num_kv_heads (8) divisible by tp_size (3)"),
        (["--block-size", "2"], "sconv SWA cache block size 2 is smaller than the kernel size 4"),
    ],
)
def test_inkling_errors(capsys, args, message):
    assert main(["layout", "inkling", *args]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(message)


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["no-such-command"])
    assert exit_.value.code == 2
