"""``import stepops`` and every CPU path work where Triton is not installed (``pyproject.toml`` installs it
on Linux only); the CUDA kernels then raise a RuntimeError that names the op and ``pip install triton``.

The check runs in a fresh interpreter whose import system refuses ``triton`` (a meta-path finder raising
ModuleNotFoundError, as on a machine without it), so no module imported here can leak Triton into it.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by test_no_triton)", name=name)
            return None


    sys.meta_path.insert(0, NoTriton())
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("the finder did not hide triton")

    import torch

    import stepops
    import stepops.models  # noqa: F401
    from stepops._library import registered_ops
    from stepops._triton import HAS_TRITON
    from stepops.testing import op_samples

    assert not HAS_TRITON
    ran = {}
    for sample in op_samples("cpu"):
        op, args, kwargs = sample
        op(*args, **kwargs)
        ran[sample.name.split("-")[0]] = ran.get(sample.name.split("-")[0], 0) + 1
    entries = registered_ops()
    assert sorted(ran) == sorted(e.name for e in entries), ran
    for entry in entries:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(entry.qualname, "CUDA"), entry.qualname
        try:
            entry.triton_kernel()
        except RuntimeError as error:
            message = str(error)
            assert entry.qualname in message and "pip install triton" in message, message
        else:
            raise AssertionError(f"{entry.qualname}: the CUDA stand-in did not raise")
    assert not [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
    print("ok", ran)
    """
)


def test_import_and_cpu_samples_without_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.startswith("ok"), run.stdout
