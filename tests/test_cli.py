"""``python -m stepops layout``: printed layouts, exit status and the exact error text.

Three runs go through a subprocess (the real entry point, from outside the checkout); the rest call
``stepops.cli.main`` in-process, since each interpreter start pays for importing torch and triton.
Expected numbers are worked out by hand in comments.
"""

import argparse
import os
import re
import signal
import subprocess
import sys

import pytest

from stepops.cli import build_parser, main
from stepops.cli.paths import check_writable_file
from stepops.layouts import InklingStream
from stepops.models.step5_config import STEP5_REFERENCE

# An MLA-style main layer: one 576-wide bf16 latent per token (1152 B).
_MLA = ["--num-kv-heads", "1", "--head-size", "576", "--head-size-v", "0"]


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
    # Step5 default, the released model's main layer: 4 KV heads x (192 + 192) x 2 B = 3072 B per token; its
    # model's block size, 16 tokens, is 49152 B = 48 rows, the first multiple of 16 that holds k = 3's 10.
    assert _row(out, "main attention layer") == "4 KV head(s) x (192 + 192) x 2 B = 3072 B per token"
    assert _row(out, "block size") == f"{STEP5_REFERENCE.block_size}" == "16"
    assert _row(out, "KV page") == "49152 B"
    assert _row(out, "required rows (7 + k)") == "10 of 1024 B"
    assert _row(out, "ring capacity").startswith("48 rows")
    assert _row(out, "rows_per_block") == "48 unpadded; block stride / 512 if strided wider"  # 1024 B / 2 B
    assert _row(out, "ring spec head_size").startswith("1536 ")  # 49152 / (16 * 2)
    assert _row(out, "smallest block size").startswith("16 (page 49152 B, capacity 48 rows)")
    # Inkling default: 8 heads of 128, hidden 4096 -> 512 per head; 2*128 + 2*512 = 1280 -> D = 2048.
    assert _row(out, "KV heads per rank (H)").startswith("8 ")
    assert _row(out, "D (head_size)") == "2048 = next power of two of 2*128 + 2*512 = 1280 (768 padding)"
    assert _row(out, "head_dim, hidden_per_head") == "128, 512"
    assert _row(out, "stream K") == "[0, 128) width 128"
    assert _row(out, "stream V") == "[128, 256) width 128"
    assert _row(out, "stream ATTN_OUT") == "[256, 768) width 512"
    assert _row(out, "stream MLP_OUT") == "[768, 1280) width 512"
    assert _row(out, "cache shape (HND)") == "[num_blocks, 8, 4, 2048] bfloat16"
    assert _row(out, "page bytes") == "131072 per block"  # 8 * 4 * 2048 * 2


def test_step5_page_too_small_exits_with_the_seed_message(tmp_path):
    # 16 tokens x 1152 B = 18432 B = 18 rows; k = 12 needs 19.
    result = _run("layout", "step5", *_MLA, "--block-size", "16", "--num-speculative-tokens", "12", cwd=tmp_path)
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
    assert _row(out, "block size") == "16"
    assert _row(out, "speculative tokens k") == "2"
    assert _row(out, "KV page") == "65536 B"
    assert _row(out, "ring capacity") == "64 rows (position p -> row p % 64)"
    assert _row(out, "ring spec head_size").startswith("2048 ")  # 65536 / (16 * 2)
    assert _row(out, "required rows (7 + k)") == "9 of 1024 B"
    assert _row(out, "main attention layer") == "8 KV head(s) x (128 + 128) x 2 B = 4096 B per token"
    # 4096 B per token: 16 tokens already hold 64 >= 9 rows.
    assert _row(out, "smallest block size").startswith("16 (page 65536 B, capacity 64 rows)")


def test_step5_value_head_size_defaults_to_the_key_head_size(capsys):
    """As AttentionSpec's: a layer with separate K and V needs only --head-size (with a default of 0, as
    before, 8 KV heads of 128 counted the keys alone: half the page). 0 is one latent."""
    assert main(["layout", "step5", "--num-kv-heads", "8", "--head-size", "128"]) == 0
    assert _row(capsys.readouterr().out, "main attention layer") == "8 KV head(s) x (128 + 128) x 2 B = 4096 B per token"
    assert main(["layout", "step5", *_MLA]) == 0
    assert _row(capsys.readouterr().out, "main attention layer") == "1 KV head(s) x (576 + 0) x 2 B = 1152 B per token"


def test_step5_fp8_main_layer_and_smallest_block_size(capsys):
    # fp8: 576 B per token; at 64 tokens 36 rows. k = 3 needs 10 rows = 10240 B -> 17.8 tokens -> 32
    # (16 tokens = 9216 B is not a whole number of rows).
    assert main(["layout", "step5", *_MLA, "--block-size", "64", "--dtype", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "KV page") == "36864 B"
    assert _row(out, "main attention layer") == "1 KV head(s) x (576 + 0) x 1 B = 576 B per token"
    assert _row(out, "smallest block size").startswith("32 (page 18432 B, capacity 18 rows)")


def test_step5_page_bytes_option(capsys):
    assert main(["layout", "step5", "--page-bytes", "16384", "--block-size", "32", "--num-speculative-tokens", "9"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "ring capacity").startswith("16 rows")
    assert _row(out, "ring spec head_size").startswith("256 ")  # 16384 / (32 * 2)
    # 512 B per token: 16 rows needed -> 16384 B -> 32 tokens.
    assert _row(out, "smallest block size").startswith("32 ")


def test_step5_partial_rows_exit_naming_the_partial_row(capsys):
    """With --page-bytes the page does not follow from the block size: the advice names --page-bytes (it
    said "choose the block size accordingly", which changes nothing in this mode)."""
    assert main(["layout", "step5", "--page-bytes", "10752", "--block-size", "16"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    first, second = captured.err.splitlines()
    assert first == (
        "Step5 CSA tail ring: a 10752-byte KV page is not a whole number of 1024-byte rows (10.5); the page "
        "must be a multiple of 1024 bytes (choose --page-bytes accordingly)"
    )
    # 10752 / 16 = 672 B per token = 21 * 32: whole 1024-byte rows only at multiples of 32 tokens (21 rows).
    assert second == "smallest block size that fits at 672 B per token: 32 (page 21504 B, capacity 21 rows)"


def test_step5_no_block_size_fits(capsys):
    # 10000 / 16 = 625 B per token, an odd number of bytes: no block size splits the page into whole bf16
    # elements per token (the ring spec's head_size), so no candidate fits. The user passed --page-bytes,
    # so that is the flag the message names.
    assert main(["layout", "step5", "--page-bytes", "10000", "--block-size", "16"]) == 1
    first, second = capsys.readouterr().err.splitlines()
    assert first == "Step5 CSA tail ring needs 10 rows of 1024 bytes in one 10000-byte KV page; increase --page-bytes."
    assert second == "smallest block size that fits at 625 B per token: none among multiples of 16 up to 4096"
    # 10001 / 16 is no whole per-token size: the page's own error alone, no line from a floored 625 B.
    assert main(["layout", "step5", "--page-bytes", "10001", "--block-size", "16"]) == 1
    assert capsys.readouterr().err == (
        "Step5 CSA tail ring needs 10 rows of 1024 bytes in one 10001-byte KV page; increase --page-bytes.\n"
    )


def test_inkling_tensor_parallel_and_enlarged_block(capsys):
    # tp 2: 4 heads per rank; D stays 2048; page = 4 * 32 * 2048 * 2.
    assert main(["layout", "inkling", "--tp-size", "2", "--block-size", "32"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "KV heads per rank (H)").startswith("4 (8 / tp_size 2)")
    assert _row(out, "cache shape (HND)") == "[num_blocks, 4, 32, 2048] bfloat16"
    assert _row(out, "page bytes") == "524288 per block"
    assert _row(out, "block size (N)") == "32 (kernel size 4)"
    # hidden_per_head = 4096 / 8 total heads, whatever tp is; D and its padding are tp-invariant too.
    assert _row(out, "head_dim, hidden_per_head") == "128, 512"
    assert _row(out, "D (head_size)") == "2048 = next power of two of 2*128 + 2*512 = 1280 (768 padding)"


def test_inkling_hidden_size_not_divisible_by_kv_heads_pads_the_last_chunk(capsys):
    assert main(["layout", "inkling", "--hidden-size", "4100"]) == 0
    out = capsys.readouterr().out
    # ceil(4100 / 8) = 513 per head, 8 * 513 - 4100 = 4 padding channels; 2*128 + 2*513 = 1282 -> 2048.
    assert _row(out, "head_dim, hidden_per_head") == "128, 513 (the last head's chunks padded by 4 zero channels)"
    assert _row(out, "stream MLP_OUT") == "[769, 1282) width 513"
    assert _row(out, "D (head_size)") == "2048 = next power of two of 2*128 + 2*513 = 1282 (766 padding)"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hidden-size", "4100", "--tp-size", "2"], "sconv SWA cache at tp_size 2 needs hidden_size (4100) divisible by num_kv_heads (8)"),
        (["--tp-size", "3"], "sconv SWA cache needs num_kv_heads (8) divisible by tp_size (3)"),
        (["--block-size", "2"], "sconv SWA cache block size 2 is smaller than the kernel size 4"),
    ],
)
def test_inkling_errors(capsys, args, message):
    assert main(["layout", "inkling", *args]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(message)


@pytest.mark.parametrize("argv", [["no-such-command"], []], ids=["unknown", "none"])
def test_unknown_or_missing_command_is_a_usage_error(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "usage: python -m stepops" in capsys.readouterr().err


def test_step5_block_size_whose_page_is_partial_rows_names_the_cause(capsys):
    # 20 tokens x 1152 B = 23040 B = 22.5 rows: enough rows, but not whole ones; 16 tokens fit.
    assert main(["layout", "step5", *_MLA, "--block-size", "20"]) == 1
    first, second = capsys.readouterr().err.splitlines()
    assert first.endswith("not a whole number of 1024-byte rows (22.5); the page must be a multiple of 1024 "
                          "bytes (choose the block size accordingly)")
    assert second == "smallest block size that fits at 1152 B per token: 16 (page 18432 B, capacity 18 rows)"


def test_step5_page_bytes_without_block_size_advises_no_block_size(capsys):
    """The per-token size of a given page needs the block size it is for: divided by the default block size
    (64 then), it advised block 96 for a page whose real block of 16 needs 32, next to "increase --page-bytes"."""
    assert main(["layout", "step5", "--page-bytes", "10240", "--num-speculative-tokens", "4"]) == 1
    assert capsys.readouterr().err == (
        "Step5 CSA tail ring needs 11 rows of 1024 bytes in one 10240-byte KV page; increase --page-bytes.\n"
    )
    assert main(["layout", "step5", "--page-bytes", "10240", "--block-size", "16", "--num-speculative-tokens", "4"]) == 1
    assert capsys.readouterr().err.splitlines()[1] == (
        "smallest block size that fits at 640 B per token: 32 (page 20480 B, capacity 20 rows)"
    )
    assert main(["layout", "step5", "--page-bytes", "65536"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "smallest block size").startswith("n/a (per-token size unknown")
    # were the default block size 16 and the head_size it gives (2048), describing no layer of the user's
    assert _row(out, "block size") == "not given"
    assert _row(out, "ring spec head_size").startswith("n/a")
    assert _row(out, "ring capacity").startswith("64 rows")  # the page alone decides the ring


def test_step5_page_bytes_too_small_names_page_bytes_and_prints_no_block_size_line(capsys):
    # A page without its block size has no per-token size: there is no block-size line to print.
    assert main(["layout", "step5", "--page-bytes", "100"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "Step5 CSA tail ring needs 10 rows of 1024 bytes in one 100-byte KV page; increase --page-bytes.\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["step5", "--block-size", "0"], "--block-size must be >= 1, got 0"),
        (["step5", "--block-size", "-16"], "--block-size must be >= 1, got -16"),
        (["step5", "--page-bytes", "-5"], "--page-bytes must be >= 1, got -5"),
        (["step5", "--num-speculative-tokens", "-1"], "--num-speculative-tokens must be >= 0, got -1"),
        (["step5", "--head-size-v", "-1"], "--head-size-v must be >= 0, got -1"),
        (["inkling", "--tp-size", "0"], "--tp-size must be >= 1, got 0"),
        (["inkling", "--block-size", "-4"], "--block-size must be >= 1, got -4"),
        # Each size flag is checked as itself (the spec and the layout refuse 0 too, naming their fields).
        (["step5", "--num-kv-heads", "0"], "--num-kv-heads must be >= 1, got 0"),
        (["step5", "--head-size", "0"], "--head-size must be >= 1, got 0"),
        (["inkling", "--num-kv-heads", "0"], "--num-kv-heads must be >= 1, got 0"),
        (["inkling", "--head-dim", "0"], "--head-dim must be >= 1, got 0"),
        (["inkling", "--hidden-size", "0"], "--hidden-size must be >= 1, got 0"),
        (["inkling", "--kernel-size", "0"], "--kernel-size must be >= 1, got 0"),
        # Past int64: the message named no flag, and a block-size line from the overflowed page followed.
        (["step5", "--page-bytes", str(2**63)], f"--page-bytes = {2**63} does not fit in int64"),
        (["step5", "--block-size", "9" * 23], f"--block-size = {'9' * 23} does not fit in int64"),
        # A page past int64 from the head numbers: the message named no input, and a block-size line from
        # the overflowed page followed.
        (
            ["step5", "--num-kv-heads", str(2**62)],
            f"page_size_bytes (block_size 16 x num_kv_heads {2**62} x (head_size 192 + head_size_v 192) x 2 B) = "
            f"{16 * 2**62 * 384 * 2} does not fit in int64",
        ),
        # Derived sizes past int64: exit 0 with a page the owner and the allocator then refused.
        (["inkling", "--head-dim", str(2**62)], f"sconv SWA cache head size D = {2**64} does not fit in int64"),
        (
            ["inkling", "--kernel-size", str(2**63 - 1)],
            f"sconv SWA cache page bytes (H * N * D * 2) = {8 * (2**63 - 1) * 2048 * 2} does not fit in int64",
        ),
    ],
)
def test_layout_values_out_of_range_are_one_line(capsys, args, message):
    assert main(["layout", *args]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == message + "\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "tpu"], "--device must be auto, cpu or cuda, got 'tpu'"),
        (["--backend", "no-such-backend"], "--backend 'no-such-backend' is not a torch.compile backend"),
        (["--tp", "0"], "--tp must be >= 1, got 0"),
        (["--tp", "3"], "--tp 3: the demo's Inkling stack has 2 KV heads per layer, which do not split into 3"),
        (["--json", "/no/such/dir/out.json"], "--json '/no/such/dir/out.json': not a writable file path"),
        (["--json", ""], "--json '': not a writable file path"),  # passed, and the demo wrote no JSON
        # Passed the directory-based check, then lost the whole run's results to a traceback at the end:
        (["--json", "/tmp/out.json/"], "--json '/tmp/out.json/': not a writable file path"),
        (["--json", "/tmp/" + "a" * 300 + ".json"], "--json '/tmp/" + "a" * 300 + ".json': not a writable file path"),
    ],
)
def test_demo_bad_arguments_are_one_line_before_any_work(capsys, monkeypatch, args, message):
    import stepops.demo

    def no_work(**kwargs):
        raise AssertionError("the demo ran with a bad argument")

    monkeypatch.setattr(stepops.demo, "run_demo", no_work)
    assert main(["demo", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"stepops demo: {message}") and captured.err.count("\n") == 1


@pytest.mark.parametrize("tp", [True, InklingStream.V], ids=repr)
def test_demo_tp_that_is_not_an_int_is_a_type_error(tp):
    """run_demo's ``tp`` from Python: an IntEnum member was taken as its value, and True was a ValueError."""
    from stepops.demo import check_demo_args

    with pytest.raises(TypeError, match=rf"--tp must be an int, got {type(tp).__name__}"):
        check_demo_args(device="cpu", backend="eager", tp=tp, json_path=None)


def test_demo_cuda_without_a_gpu_is_one_line(capsys, monkeypatch):
    import stepops.demo
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(stepops.demo, "run_demo", lambda **kwargs: 0)
    assert main(["demo", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == "stepops demo: --device cuda: this torch build sees no CUDA device; use --device cpu or auto\n"


def test_demo_tp_above_the_cpu_cores_is_one_line(capsys, monkeypatch):
    import os

    import stepops.demo

    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setattr(stepops.demo, "run_demo", lambda **kwargs: 0)
    assert main(["demo", "--tp", "2", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == "stepops demo: --tp 2 needs one CPU core per rank; this machine has 1 CPU cores\n"


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _subparsers(sub)


def test_every_option_with_a_default_names_it_in_its_help():
    """``--help`` is the reference a user reads: an option that has a default says which (demo's --device
    and layout step5's --dtype did not)."""
    missing = []
    for sub in _subparsers(build_parser()):
        for action in sub._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            if "default" not in (action.help or ""):
                missing.append(f"{sub.prog} {action.option_strings[0]}")
    assert missing == []


def test_demo_cuda_index_past_the_gpus_is_a_value_error(monkeypatch):
    """``--device cuda:7`` on a one-GPU machine failed deep inside building the model."""
    import torch

    from stepops.demo import check_demo_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--device cuda:7: this machine has 1 GPUs \(cuda:0 onwards\)"):
        check_demo_args(device="cuda:7", backend="eager", tp=1, json_path=None)
    with pytest.raises(ValueError, match=r"--device cuda:1: this machine has 1 GPUs"):  # the first index past
        check_demo_args(device="cuda:1", backend="eager", tp=1, json_path=None)
    assert check_demo_args(device="cuda:0", backend="eager", tp=1, json_path=None) == torch.device("cuda", 0)
    # The tensor-parallel ranks take cuda:0 .. cuda:tp-1: an index would be dropped.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="--tp 2 runs rank r on cuda:r; pass --device cuda or auto, not cuda:1"):
        check_demo_args(device="cuda:1", backend="eager", tp=2, json_path=None)


def test_the_output_path_check_leaves_no_file_behind_and_no_byte_changed(tmp_path):
    new, existing = tmp_path / "new.json", tmp_path / "old.json"
    existing.write_text("results")
    check_writable_file("--json", new)
    check_writable_file("--json", existing)
    assert not new.exists() and existing.read_text() == "results"


def test_the_output_path_check_refuses_a_fifo_without_a_reader_at_once(tmp_path):
    """Opened for writing without a reader, a FIFO blocks until one comes: the demo would hang before any
    work. The alarm turns a hang into a failure instead of a stuck test run; its exception must not be an
    OSError (as TimeoutError is), which the check would turn into the very ValueError expected here."""
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)

    class Hung(Exception):
        pass

    def hung(signum, frame):
        raise Hung("check_writable_file blocked on a FIFO without a reader")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    try:
        with pytest.raises(ValueError, match="not a writable file path"):
            check_writable_file("--json", fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
