"""Every Triton kernel compiles for sm_90a and sm_80; resources and load widths are snapshotted.

The builds run in a subprocess without ``TRITON_INTERPRET`` (this test process has it set, and
interpreted kernels cannot be compiled). Register counts and SASS depend on the Triton version, so the
snapshot is compared only on the version it was taken with; compile failures and unexplained spills
fail on every version.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import triton
from expecttest import TestCase

from stepops._library import registered_ops
from stepops.testing.gpu_build import _ALLOW_SPILL, KernelBuild, unsupported_reason

SNAPSHOT_TRITON_VERSION = "3.9.0"


def _run_without_interpreter(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences Triton 3.9's notice; launchers set fusion per kernel
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


def _build(**overrides) -> KernelBuild:
    fields = dict(op="op", kernel="_k", config="BLOCK=128 warps=4", target="sm_90a", registers=32, stack=0,
                  local_bytes=0, shared_bytes=0, num_warps=4, global_loads="128x1", global_stores="128x1",
                  barriers=0, spill_allowed=False)
    fields.update(overrides)
    return KernelBuild(**fields)


class TestGpuBuild(TestCase):
    def setUp(self):
        # The check drives Triton's compile internals, which move between releases (written for 3.8-3.9).
        reason = unsupported_reason()
        if reason:
            self.skipTest(reason)

    def test_every_kernel_builds_without_unexplained_spills(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "builds.json")
            result = _run_without_interpreter("-m", "stepops.testing.gpu_build", "--json", path)
            self.assertEqual(result.returncode, 0, result.stderr[-4000:])
            with open(path) as f:
                builds = json.load(f)
        self.assertEqual({b["op"] for b in builds}, {e.name for e in registered_ops()})
        self.assertEqual({b["target"] for b in builds}, {"sm_90a", "sm_80"})
        # The ring kernel's leader reads the ring before it stores: its barrier must survive compilation
        # (the sequential interpreter cannot notice a missing one).
        ring = [b for b in builds if b["op"] == "csa_ring_update"]
        self.assertTrue(ring and all(b["barriers"] >= 1 for b in ring), ring)
        table = result.stdout.strip()
        if triton.__version__ == SNAPSHOT_TRITON_VERSION:
            self.assertExpectedInline(table, """\
op               kernel                   config                                                                                                                                                                 target  regs  stack  local  smem  occupancy  bar  LDG bits          STG bits
csa_ring_update  _csa_ring_update_kernel  P=16 BLOCK_P=16 FP8_SUMMARY=False REVERSE_GRID=False warps=1 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                     sm_80   64    0      0      0     50%        1    32x6 16x48        16x17
csa_ring_update  _csa_ring_update_kernel  P=16 BLOCK_P=16 FP8_SUMMARY=False REVERSE_GRID=False warps=1 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                     sm_90a  64    0      0      0     50%        1    32x6 16x48        16x17
csa_ring_update  _csa_ring_update_kernel  P=16 BLOCK_P=16 FP8_SUMMARY=True REVERSE_GRID=False warps=1 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                      sm_80   64    0      0      0     50%        1    32x6 16x48        16x16 8x1
csa_ring_update  _csa_ring_update_kernel  P=16 BLOCK_P=16 FP8_SUMMARY=True REVERSE_GRID=False warps=1 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                      sm_90a  72    0      0      0     44%        1    32x6 16x48        16x16 8x1
csa_ring_update  _csa_ring_update_kernel  P=256 BLOCK_P=256 FP8_SUMMARY=False REVERSE_GRID=False warps=2 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                   sm_80   168   0      0      0     19%        1    64x48 32x6        64x17
csa_ring_update  _csa_ring_update_kernel  P=256 BLOCK_P=256 FP8_SUMMARY=False REVERSE_GRID=False warps=2 | 1: stride_k1,stride_z1,stride_ring1,stride_summary1                                                   sm_90a  168   0      0      0     19%        1    64x48 32x6        64x17
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=1 BLOCK_D=8 BLOCK_DV=16 warps=4 | 1: num_heads,key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                             sm_80   21    0      0      0     100%       0    32x3              32x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=1 BLOCK_D=8 BLOCK_DV=16 warps=4 | 1: num_heads,key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                             sm_90a  24    0      0      0     100%       0    32x3              32x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=16 BLOCK_DV=16 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                      sm_80   20    0      0      0     100%       0    32x1 16x2         16x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=16 BLOCK_DV=16 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                      sm_90a  22    0      0      0     100%       0    32x1 16x2         16x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=4 BLOCK_DV=4 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                        sm_80   20    0      0      0     100%       0    32x1 16x2         16x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=4 BLOCK_DV=4 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                        sm_90a  22    0      0      0     100%       0    32x1 16x2         16x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=8 BLOCK_DV=8 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                        sm_80   20    0      0      0     100%       0    32x1 16x2         16x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=2 BLOCK_D=8 BLOCK_DV=8 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                        sm_90a  22    0      0      0     100%       0    32x1 16x2         16x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=4 BLOCK_D=8 BLOCK_DV=4 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                        sm_80   21    0      0      0     100%       0    64x1 16x2         16x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=4 BLOCK_D=8 BLOCK_DV=4 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                        sm_90a  24    0      0      0     100%       0    64x1 16x2         16x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=8 BLOCK_D=128 BLOCK_DV=128 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                    sm_80   26    0      0      0     100%       0    128x2 32x1        128x2
paged_kv_write   _paged_kv_write_kernel   BLOCK_H=8 BLOCK_D=128 BLOCK_DV=128 warps=4 | 1: key_stride_d,value_stride_d,key_cache_stride_d,value_cache_stride_d                                                    sm_90a  27    0      0      0     100%       0    128x2 32x1        128x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=False SILU=False BLOCK_W=16 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                 sm_80   41    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=False SILU=False BLOCK_W=16 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                 sm_90a  45    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=1024 warps=4 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                sm_80   96    0      0      0     31%        0    32x36 16x104      16x16
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=1024 warps=4 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                sm_90a  162   0      0      0     19%        0    32x36 16x104      16x16
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=128 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                 sm_80   58    0      0      0     50%        0    64x9 32x8 16x16   64x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=128 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                 sm_90a  53    0      0      0     50%        0    64x9 32x8 16x16   64x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=16 warps=1 | 1: max_blocks,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_request,stride_table_block  sm_80   42    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=16 warps=1 | 1: max_blocks,stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_request,stride_table_block  sm_90a  41    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=16 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                  sm_80   41    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=16 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                  sm_90a  43    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=32 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                  sm_80   40    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=32 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                  sm_90a  43    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=512 warps=2 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                 sm_80   48    0      0      0     66%        0    128x9 32x8 16x32  128x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=512 warps=2 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                 sm_90a  72    0      0      0     44%        0    128x9 32x8 16x32  128x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=8 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                   sm_80   41    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=False BLOCK_W=8 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                   sm_90a  43    0      0      0     50%        0    32x8 16x13        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=True BLOCK_W=8 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                    sm_80   38    0      0      0     50%        0    32x12 16x9        16x2
sconv            _sconv_kernel            KERNEL_SIZE=4 RESIDUAL=True SILU=True BLOCK_W=8 warps=1 | 1: stride_x_channel,stride_weight_tap,stride_cache_dim,stride_table_block                                    sm_90a  40    0      0      0     50%        0    32x12 16x9        16x2""")

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
        match = _ALLOW_SPILL.search("    # gpu-build: allow-spill _k: the W=64 taps do not fit registers")
        self.assertEqual(match.group(1), "_k")
        self.assertIsNone(_ALLOW_SPILL.search("# gpu-build: allow-spill _k:"))  # a reason is required

    def test_occupancy_follows_the_sm90_limits(self):
        # 32 regs x 4 warps: registers allow 16 blocks, the 64-warp limit caps it: full occupancy.
        self.assertEqual(_build(registers=32).occupancy, 1.0)
        # 255 regs -> 8192 per warp -> 8 warps per SM -> 2 blocks of 4 warps = 8 of 64 warps.
        self.assertEqual(_build(registers=255).occupancy, 8 / 64)
        # 100 KiB shared memory per block: 2 blocks per SM = 8 of 64 warps.
        self.assertEqual(_build(shared_bytes=100 * 1024).occupancy, 8 / 64)
