"""Every Triton kernel compiles for sm_90a and sm_80, at the samples' shapes and at the benchmarks' decode
shapes; resources and load widths are snapshotted; the memory round trips of each kernel at model shapes
are bounded; the SASS analysis that counts them is tested on its own.

The builds run in a subprocess without ``TRITON_INTERPRET`` (this test process has it set, and
interpreted kernels cannot be compiled): one ``python -m benchmarks static --json`` run serves the tests
that read builds. Register counts and SASS depend on the Triton version, so the snapshot and the bounds are
compared only on the version they were taken with; compile failures and unexplained spills fail on every
version.
"""

import functools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import triton
from expecttest import TestCase

from stepops._library import registered_ops
from stepops.testing import gpu_build
from stepops.testing.gpu_build import ALLOW_SPILL, KernelBuild, LoadChains, build_calls, load_chains, unsupported_reason

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOT_TRITON_VERSION = "3.9.0"


# Memory round trips a thread of each kernel waits for in turn at the benchmarks' decode shapes (sm_90a and
# sm_80, Triton SNAPSHOT_TRITON_VERSION). csa_ring_update: metadata, then the rows they address (issue 16;
# 19 before it). paged_kv_write: 3. sconv: its dependent chain is 3 (metadata, block-table entry, cache
# row), but at the models' K+V width (256 channels, 8 per thread: 17 128-bit loads) ptxas waits for them in
# 5 rounds, the kernel before issue 16 as well (3 at width 128, where a layer made two such launches). A
# kernel that issues a load after an instruction waiting for an earlier one, or addresses a load by a
# loaded value, exceeds these.
MAX_ROUND_TRIPS = {"_csa_ring_update_kernel": 2, "_paged_kv_write_kernel": 3, "_sconv_kernel": 5}


def _run_without_interpreter(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


@functools.lru_cache(maxsize=1)
def _static_report() -> tuple[subprocess.CompletedProcess, dict]:
    """``python -m benchmarks static --json``, once per test session."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "static.json")
        result = _run_without_interpreter("-m", "benchmarks", "static", "--json", path)
        report = json.loads(Path(path).read_text()) if result.returncode == 0 else {}
    return result, report


def _build(**overrides) -> KernelBuild:
    fields = dict(op="op", kernel="_k", config="BLOCK=128 warps=4", target="sm_90a", registers=32, stack=0,
                  local_bytes=0, shared_bytes=0, num_warps=4, global_loads="128x1", global_stores="128x1",
                  barriers=0, spill_allowed=False)
    fields.update(overrides)
    return KernelBuild(**fields)


@pytest.mark.parametrize("interpret", ["1", "true"])
def test_builds_refuse_a_process_that_interprets_kernels(monkeypatch, interpret):
    """Under ``TRITON_INTERPRET`` a kernel is a Python function: there is nothing to compile or count."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    with pytest.raises(RuntimeError, match="needs a process without TRITON_INTERPRET"):
        build_calls(())


def test_builds_name_what_this_triton_lacks_instead_of_failing_inside_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(gpu_build, "unsupported_reason", lambda: "Triton 0.0 has no compiler")
    with pytest.raises(RuntimeError, match="^Triton 0.0 has no compiler$"):
        build_calls(())


class TestGpuBuild(TestCase):
    def setUp(self):
        # The check drives Triton's compile internals, which move between releases (written for 3.8-3.9).
        reason = unsupported_reason()
        if reason:
            self.skipTest(reason)

    def test_every_kernel_builds_without_unexplained_spills(self):
        result, report = _static_report()
        self.assertEqual(result.returncode, 0, result.stderr[-4000:])
        # Triton 3.9 warns when a launch leaves FP fusion to its default, which Triton 3.10 flips: every
        # stepops launch states it.
        self.assertNotIn("TRITON_DEFAULT_FP_FUSION is unset", result.stderr)
        builds = report["builds"]
        self.assertEqual({b["op"] for b in builds}, {e.name for e in registered_ops()})
        self.assertEqual({b["target"] for b in builds}, {"sm_90a", "sm_80"})
        # The ring kernel's leader reads the ring before it stores: its barrier must survive compilation
        # (the sequential interpreter cannot notice a missing one).
        ring = [b for b in builds if b["op"] == "csa_ring_update"]
        self.assertTrue(ring and all(b["barriers"] >= 1 for b in ring), ring)
        table = result.stdout.split("\n\n")[0].strip()  # the builds; the estimates follow a blank line
        if triton.__version__ == SNAPSHOT_TRITON_VERSION:
            self.assertExpectedInline(table, """\
op               shapes       kernel                   config                                                                                                                                                                                                       target  regs  stack  local  smem  occupancy  bar  trips  chain  LDG bits          STG bits
csa_ring_update  samples      _csa_ring_update_kernel  P=16 BLOCK_P=16 FP8_SUMMARY=False REVERSE_GRID=False HAS_ERRORS=False warps=1 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                          sm_80   64    0      0      0     50%        1    2      2      64x2 32x11 16x18  64x2 16x3
csa_ring_update  samples      _csa_ring_update_kernel  P=16 BLOCK_P=16 FP8_SUMMARY=False REVERSE_GRID=False HAS_ERRORS=False warps=1 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                          sm_90a  64    0      0      0     50%        1    2      2      64x2 32x11 16x18  64x2 16x3
csa_ring_update  samples      _csa_ring_update_kernel  P=16 BLOCK_P=16 FP8_SUMMARY=True REVERSE_GRID=False HAS_ERRORS=False warps=1 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                           sm_80   63    0      0      0     50%        1    2      2      64x2 32x11 16x18  64x2 16x2 8x1
csa_ring_update  samples      _csa_ring_update_kernel  P=16 BLOCK_P=16 FP8_SUMMARY=True REVERSE_GRID=False HAS_ERRORS=False warps=1 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                           sm_90a  64    0      0      0     50%        1    2      2      64x2 32x11 16x18  64x2 16x2 8x1
csa_ring_update  samples      _csa_ring_update_kernel  P=256 BLOCK_P=256 FP8_SUMMARY=False REVERSE_GRID=False HAS_ERRORS=False warps=4 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                        sm_80   56    0      0      0     56%        1    2      2      128x4 32x29       128x4 32x3
csa_ring_update  samples      _csa_ring_update_kernel  P=256 BLOCK_P=256 FP8_SUMMARY=False REVERSE_GRID=False HAS_ERRORS=False warps=4 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                        sm_90a  56    0      0      0     56%        1    2      2      128x4 32x29       128x4 32x3
csa_ring_update  decode_r256  _csa_ring_update_kernel  P=256 BLOCK_P=256 FP8_SUMMARY=False REVERSE_GRID=False HAS_ERRORS=False warps=4 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                        sm_80   56    0      0      0     56%        1    2      2      128x4 32x29       128x4 32x3
csa_ring_update  decode_r256  _csa_ring_update_kernel  P=256 BLOCK_P=256 FP8_SUMMARY=False REVERSE_GRID=False HAS_ERRORS=False warps=4 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                        sm_90a  56    0      0      0     56%        1    2      2      128x4 32x29       128x4 32x3
csa_ring_update  decode_r64   _csa_ring_update_kernel  P=256 BLOCK_P=256 FP8_SUMMARY=False REVERSE_GRID=False HAS_ERRORS=False warps=4 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                        sm_80   56    0      0      0     56%        1    2      2      128x4 32x29       128x4 32x3
csa_ring_update  decode_r64   _csa_ring_update_kernel  P=256 BLOCK_P=256 FP8_SUMMARY=False REVERSE_GRID=False HAS_ERRORS=False warps=4 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                                        sm_90a  56    0      0      0     56%        1    2      2      128x4 32x29       128x4 32x3
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=1 BLOCK_D=8 BLOCK_DV=16 HAS_ERRORS=False warps=4 | 1: num_heads,key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                  sm_80   20    0      0      0     100%       0    3      1      32x3              32x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=1 BLOCK_D=8 BLOCK_DV=16 HAS_ERRORS=False warps=4 | 1: num_heads,key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                  sm_90a  24    0      0      0     100%       0    3      1      32x3              32x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=16 BLOCK_DV=16 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                           sm_80   26    0      0      0     100%       0    3      1      32x1 16x2         16x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=16 BLOCK_DV=16 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                           sm_90a  26    0      0      0     100%       0    3      1      32x1 16x2         16x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=4 BLOCK_DV=4 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                             sm_80   26    0      0      0     100%       0    3      1      32x1 16x2         16x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=4 BLOCK_DV=4 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                             sm_90a  26    0      0      0     100%       0    3      1      32x1 16x2         16x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=8 BLOCK_DV=8 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                             sm_80   26    0      0      0     100%       0    3      1      32x1 16x2         16x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=8 BLOCK_DV=8 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                             sm_80   20    0      0      0     100%       0    3      1      32x1 8x2          8x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=8 BLOCK_DV=8 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                             sm_90a  26    0      0      0     100%       0    3      1      32x1 16x2         16x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=8 BLOCK_DV=8 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                             sm_90a  20    0      0      0     100%       0    3      1      32x1 8x2          8x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=4 BLOCK_D=8 BLOCK_DV=4 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                             sm_80   20    0      0      0     100%       0    3      1      64x1 16x2         16x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=4 BLOCK_D=8 BLOCK_DV=4 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                             sm_90a  22    0      0      0     100%       0    3      1      64x1 16x2         16x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=8 BLOCK_D=128 BLOCK_DV=128 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                         sm_80   26    0      0      0     100%       0    3      1      128x2 32x1        128x2
paged_kv_write   samples      _paged_kv_write_kernel   BLOCK_H=8 BLOCK_D=128 BLOCK_DV=128 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                         sm_90a  26    0      0      0     100%       0    3      1      128x2 32x1        128x2
paged_kv_write   decode_r256  _paged_kv_write_kernel   BLOCK_H=8 BLOCK_D=128 BLOCK_DV=128 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                         sm_80   26    0      0      0     100%       0    3      1      128x2 32x1        128x2
paged_kv_write   decode_r256  _paged_kv_write_kernel   BLOCK_H=8 BLOCK_D=128 BLOCK_DV=128 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                         sm_90a  26    0      0      0     100%       0    3      1      128x2 32x1        128x2
paged_kv_write   decode_r64   _paged_kv_write_kernel   BLOCK_H=8 BLOCK_D=128 BLOCK_DV=128 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                         sm_80   26    0      0      0     100%       0    3      1      128x2 32x1        128x2
paged_kv_write   decode_r64   _paged_kv_write_kernel   BLOCK_H=8 BLOCK_D=128 BLOCK_DV=128 HAS_ERRORS=False warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                                         sm_90a  26    0      0      0     100%       0    3      1      128x2 32x1        128x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=False SILU=False HEADS=2 BLOCK_W=16 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                              sm_80   44    0      0      0     50%        0    3      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=False SILU=False HEADS=2 BLOCK_W=16 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                              sm_90a  46    0      0      0     50%        0    5      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=1024 HAS_ERRORS=False warps=4 | 1: num_heads,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                   sm_80   111   0      0      0     25%        0    16     3      32x8 16x104       16x16
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=1024 HAS_ERRORS=False warps=4 | 1: num_heads,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                   sm_90a  110   0      0      0     25%        0    13     3      32x8 16x104       16x16
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=256 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_80   66    0      0      0     44%        0    5      3      128x17 32x8       128x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=256 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_90a  72    0      0      0     44%        0    5      3      128x17 32x8       128x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=512 HAS_ERRORS=False warps=2 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_80   56    0      0      0     56%        0    6      3      128x17 32x8       128x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=512 HAS_ERRORS=False warps=2 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_90a  72    0      0      0     44%        0    5      3      128x17 32x8       128x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=128 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_80   66    0      0      0     44%        0    5      3      128x17 32x8       128x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=128 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_90a  72    0      0      0     44%        0    5      3      128x17 32x8       128x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=16 HAS_ERRORS=False warps=1 | 1: num_requests,max_blocks,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_request,stride_table_block  sm_80   44    0      0      0     50%        0    4      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=16 HAS_ERRORS=False warps=1 | 1: num_requests,max_blocks,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_request,stride_table_block  sm_90a  50    0      0      0     50%        0    5      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=16 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                               sm_80   44    0      0      0     50%        0    3      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=16 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                               sm_90a  50    0      0      0     50%        0    5      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=32 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                               sm_80   49    0      0      0     50%        0    6      3      32x8 16x26        16x4
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=32 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                               sm_90a  54    0      0      0     50%        0    6      3      32x8 16x26        16x4
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: max_blocks,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_request,stride_table_block                sm_80   44    0      0      0     50%        0    3      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: max_blocks,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_request,stride_table_block                sm_90a  50    0      0      0     50%        0    5      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: num_tokens,num_requests,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                        sm_80   42    0      0      0     50%        0    5      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: num_tokens,num_requests,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                        sm_90a  43    0      0      0     50%        0    6      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                                sm_80   44    0      0      0     50%        0    3      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                                sm_90a  48    0      0      0     50%        0    5      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: stride_x_token,stride_weight_tap,stride_cache_dim,stride_table_block                                                  sm_80   42    0      0      0     50%        0    3      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: stride_x_token,stride_weight_tap,stride_cache_dim,stride_table_block                                                  sm_90a  46    0      0      0     50%        0    3      3      32x8 16x13        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=4 BLOCK_W=16 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                           sm_80   44    0      0      0     50%        0    3      3      64x4 32x17        32x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=4 BLOCK_W=16 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                           sm_90a  46    0      0      0     50%        0    5      3      64x4 32x17        32x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=True HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                                 sm_80   44    0      0      0     50%        0    4      3      32x12 16x9        16x2
sconv            samples      _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=True HEADS=2 BLOCK_W=8 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                                 sm_90a  56    0      0      0     50%        0    5      3      32x12 16x9        16x2
sconv            decode_r256  _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=256 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_80   66    0      0      0     44%        0    5      3      128x17 32x8       128x2
sconv            decode_r256  _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=256 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_90a  72    0      0      0     44%        0    5      3      128x17 32x8       128x2
sconv            decode_r64   _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=256 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_80   66    0      0      0     44%        0    5      3      128x17 32x8       128x2
sconv            decode_r64   _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False HEADS=1 BLOCK_W=256 HAS_ERRORS=False warps=1 | 1: stride_x_channel,stride_weight_channel,stride_cache_dim,stride_table_block                                          sm_90a  72    0      0      0     44%        0    5      3      128x17 32x8       128x2""")

    def test_kernels_at_decode_shapes_stay_within_their_round_trips_without_spills(self):
        result, report = _static_report()
        self.assertEqual(result.returncode, 0, result.stderr[-4000:])
        decode = [b for b in report["builds"] if b["shapes"].startswith("decode_")]
        self.assertEqual({b["op"] for b in decode}, {e.name for e in registered_ops()})
        self.assertEqual({b["kernel"] for b in decode}, set(MAX_ROUND_TRIPS), "a bound for every kernel")
        self.assertEqual({(b["shapes"], b["target"]) for b in decode},
                         {(s, t) for s in ("decode_r64", "decode_r256") for t in ("sm_90a", "sm_80")})
        for b in decode:
            where = f"{b['kernel']} [{b['config']}] {b['shapes']} {b['target']}"
            self.assertEqual((b["local_bytes"], b["stack"]), (0, 0), f"{where} spills")
            self.assertGreaterEqual(b["load_round_trips"], b["load_address_chain"], where)
            if triton.__version__ == SNAPSHOT_TRITON_VERSION:
                self.assertLessEqual(b["load_round_trips"], MAX_ROUND_TRIPS[b["kernel"]], where)

    def test_decode_estimates_follow_their_formula_for_every_op(self):
        result, report = _static_report()
        self.assertEqual(result.returncode, 0, result.stderr[-4000:])
        c = report["constants"]
        estimates = {(e["op"], e["decode_tokens"]): e for e in report["estimates"]}
        self.assertEqual(set(estimates), {(e.name, n) for e in registered_ops() for n in (64, 256)})
        for e in report["estimates"] + report["before"]:
            floor_us = e["floor_bytes"] / c["bandwidth_bytes_per_us"]
            want = len(e["kernels"]) * c["launch_us"] + e["round_trips"] * c["memory_latency_us"] + floor_us
            self.assertAlmostEqual(e["estimated_us"], want, places=9)
            self.assertAlmostEqual(e["floor_percent"], 100 * floor_us / want, places=9)
            self.assertTrue(1 <= e["dependent_load_chain"] <= e["round_trips"], e)
        # csa_ring_update before issue 16, measured at the same shapes (benchmarks/static_baseline.json).
        before = {e["decode_tokens"]: e for e in report["before"]}
        self.assertEqual(set(before), {64, 256})
        for tokens, old in before.items():
            self.assertEqual((old["op"], old["round_trips"], old["dependent_load_chain"], old["registers"]),
                             ("csa_ring_update", 19, 3, 168))
            new = estimates["csa_ring_update", tokens]
            self.assertAlmostEqual(old["new_over_before"], new["floor_percent"] / old["floor_percent"])
            if triton.__version__ == SNAPSHOT_TRITON_VERSION:
                self.assertGreaterEqual(old["new_over_before"], 4.0)
        self.assertIn("new / before: 4.", result.stdout)

    def test_a_kernel_that_does_not_compile_names_kernel_config_and_target(self):
        script = textwrap.dedent(
            """
            import torch, triton, triton.language as tl
            from stepops.testing import gpu_build

            NOT_CONSTEXPR = 3

            @triton.jit
            def _broken_kernel(x_ptr, BLOCK: tl.constexpr):
                offs = tl.arange(0, BLOCK)
                tl.store(x_ptr + offs, tl.load(x_ptr + offs) * NOT_CONSTEXPR)

            def launcher(x):
                _broken_kernel[(1,)](x, BLOCK=64)

            launch = gpu_build._Launch("demo_op", launcher, _broken_kernel, (torch.zeros(64),), {"BLOCK": 64})
            gpu_build._compile(launch, "sm_90a", 90)
            """
        )
        with tempfile.TemporaryDirectory() as tmp:  # @triton.jit needs its source in a file
            path = os.path.join(tmp, "broken_kernel.py")
            with open(path, "w") as f:
                f.write(script)
            result = _run_without_interpreter(path)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("demo_op: _broken_kernel [BLOCK=64 warps=4] does not compile for sm_90a", result.stderr)
        self.assertIn("NOT_CONSTEXPR", result.stderr)

    def test_spills_fail_unless_the_launcher_justifies_them(self):
        self.assertEqual(_build().problems, [])
        self.assertEqual(len(_build(local_bytes=16).problems), 1)
        self.assertEqual(len(_build(stack=8).problems), 1)
        self.assertEqual(_build(local_bytes=16, spill_allowed=True).problems, [])
        match = ALLOW_SPILL.search("    # gpu-build: allow-spill _k: the W=64 taps do not fit registers")
        self.assertEqual(match.group(1), "_k")
        self.assertIsNone(ALLOW_SPILL.search("# gpu-build: allow-spill _k:"))  # a reason is required

    def test_occupancy_follows_the_sm90_limits(self):
        # 32 regs x 4 warps: registers allow 16 blocks, the 64-warp limit caps it: full occupancy.
        self.assertEqual(_build(registers=32).occupancy, 1.0)
        # 255 regs -> 8192 per warp -> 8 warps per SM -> 2 blocks of 4 warps = 8 of 64 warps.
        self.assertEqual(_build(registers=255).occupancy, 8 / 64)
        # 100 KiB shared memory per block: 2 blocks per SM = 8 of 64 warps.
        self.assertEqual(_build(shared_bytes=100 * 1024).occupancy, 8 / 64)

    def test_load_chains_of_hand_written_sass(self):
        cases = {
            "independent loads": (["LDG.E R2, desc[UR4][R4.64]", "LDG.E.64 R6, desc[UR4][R8.64]",
                                   "FADD R3, R2, R6"], LoadChains(1, 1)),
            "address from a loaded value": (["LDG.E R2, desc[UR4][R4.64]", "IMAD.WIDE R6, R2, 0x4, R8",
                                             "LDG.E R10, desc[UR4][R6.64]"], LoadChains(2, 2)),
            "a 128-bit load's upper registers": (["LDG.E.128 R4, desc[UR4][R2.64]", "IADD3 R8, R7, 0x1, RZ",
                                                  "LDG.E R9, desc[UR4][R8.64]"], LoadChains(2, 2)),
            "a load issued after a use of another (in order)": (
                ["LDG.E R2, desc[UR4][R4.64]", "FADD R3, R2, R2", "LDG.E R6, desc[UR4][R8.64]"], LoadChains(2, 1)),
            "a predicate from a loaded value": (
                ["LDG.E R2, desc[UR4][R4.64]", "ISETP.GT.AND P0, PT, R2, RZ, PT", "@P0 LDG.E R6, desc[UR4][R8.64]"],
                LoadChains(2, 2)),
            "a uniform register from a loaded value": (
                ["LDG.E R2, desc[UR4][R4.64]", "R2UR UR6, R2", "IADD3 R8, UR6, R9, RZ",
                 "LDG.E R6, desc[UR4][R8.64]"], LoadChains(2, 2)),
            "a branch on a loaded value": (
                ["LDG.E R2, desc[UR4][R4.64]", "ISETP.GT.AND P0, PT, R2, RZ, PT", "@P0 BRA `(.L_x_0)",
                 "NOP", ".L_x_0:", "LDG.E R6, desc[UR4][R8.64]"], LoadChains(2, 1)),
            "a barrier waits for the loads before it": (
                ["LDG.E R2, desc[UR4][R4.64]", "BAR.SYNC.DEFER_BLOCKING 0x0", "LDG.E R6, desc[UR4][R8.64]"],
                LoadChains(2, 1)),
            "stores wait for their data": (
                ["LDG.E R2, desc[UR4][R4.64]", "STG.E desc[UR4][R8.64], R2", "LDG.E R6, desc[UR4][R10.64]"],
                LoadChains(2, 1)),
            # The taken branch skips the redefinition: at the join, R6 may still be the loaded value.
            "paths merge by maximum": (
                ["LDG.E R6, desc[UR4][R4.64]", "ISETP.GT.AND P0, PT, R9, RZ, PT", "@P0 BRA `(.L_x_1)",
                 "MOV R6, R11", ".L_x_1:", "IMAD.WIDE R12, R6, 0x4, R8", "LDG.E R7, desc[UR4][R12.64]"],
                LoadChains(2, 2)),
            "a predicated definition may keep the old value": (
                ["LDG.E R6, desc[UR4][R4.64]", "@P1 MOV R6, R11", "IMAD.WIDE R12, R6, 0x4, R8",
                 "LDG.E R7, desc[UR4][R12.64]"], LoadChains(2, 2)),
            "an unconditional redefinition ends the chain": (
                ["LDG.E R6, desc[UR4][R4.64]", "MOV R6, R11", "IMAD.WIDE R12, R6, 0x4, R8",
                 "LDG.E R7, desc[UR4][R12.64]"], LoadChains(1, 1)),
            "code after an unconditional EXIT is not reached": (
                ["LDG.E R2, desc[UR4][R4.64]", "FADD R3, R2, R2", "EXIT", "LDG.E R6, desc[UR4][R8.64]"],
                LoadChains(1, 1)),
            "pointer chasing in a loop": (
                [".L_x_2:", "LDG.E.64 R2, desc[UR4][R2.64]", "ISETP.NE.AND P0, PT, R2, RZ, PT",
                 "@P0 BRA `(.L_x_2)", "EXIT"], LoadChains(64, 64)),
        }
        for name, (lines, want) in cases.items():
            with self.subTest(name):
                self.assertEqual(load_chains(_sass(lines)), want)

    def test_load_chains_of_compiled_kernels(self):
        """The analysis on SASS that ptxas wrote: a gather, a load after an earlier load's use, and two
        independent loads, compiled for sm_90a."""
        script = textwrap.dedent(
            """
            import json, torch, triton, triton.language as tl
            from stepops.testing import gpu_build

            @triton.jit
            def _independent(x_ptr, y_ptr, out_ptr, BLOCK: tl.constexpr):
                d = tl.arange(0, BLOCK)
                tl.store(out_ptr + d, tl.load(x_ptr + d) + tl.load(y_ptr + d))

            @triton.jit
            def _gather(index_ptr, x_ptr, out_ptr, BLOCK: tl.constexpr):
                d = tl.arange(0, BLOCK)
                tl.store(out_ptr + d, tl.load(x_ptr + tl.load(index_ptr + d)))

            @triton.jit
            def _use_then_load(n_ptr, x_ptr, out_ptr, BLOCK: tl.constexpr):
                d = tl.arange(0, BLOCK)
                n = tl.load(n_ptr)
                if n > 0:  # the branch waits for n; the load after it is a second round trip
                    tl.store(out_ptr + d, tl.load(x_ptr + d))

            def launcher():  # gpu_build reads spill permissions from a launcher's source
                pass

            out = {}
            for fn, first in ((_independent, torch.zeros(64)), (_gather, torch.zeros(64, dtype=torch.int32)),
                              (_use_then_load, torch.ones(1, dtype=torch.int32))):
                launch = gpu_build._Launch("demo", launcher, fn, (first, torch.zeros(64), torch.zeros(64)), {"BLOCK": 64})
                build = gpu_build._compile(launch, "sm_90a", 90)
                out[fn.__name__] = [build.load_round_trips, build.load_address_chain]
            print(json.dumps(out))
            """
        )
        with tempfile.TemporaryDirectory() as tmp:  # @triton.jit needs its source in a file
            path = os.path.join(tmp, "chain_kernels.py")
            with open(path, "w") as f:
                f.write(script)
            result = _run_without_interpreter(path)
        self.assertEqual(result.returncode, 0, result.stderr[-4000:])
        self.assertEqual(json.loads(result.stdout.strip().splitlines()[-1]),
                         {"_independent": [1, 1], "_gather": [2, 2], "_use_then_load": [2, 1]})


def _sass(lines: list[str]) -> str:
    """nvdisasm -c style text: labels as they are, instructions with an address."""
    out, address = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{address:04x}*/                   {line} ;")
            address += 16
    return "\n".join(out)
