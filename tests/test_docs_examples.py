"""The docs' self-contained python examples run as a user would paste them (the sconv and csa_ring_update
examples of docs/ops.md run in their op tests); a fragment that continues an earlier example runs after it."""

import re
from pathlib import Path

import torch

from stepops.testing import TOLERANCES

_DOCS = Path(__file__).resolve().parents[1] / "docs"


def _python_blocks(page: str, section: str | None = None) -> list[str]:
    text = (_DOCS / page).read_text()
    if section is not None:
        text = text.split(section, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_ops_paged_kv_write_example():
    (code,) = _python_blocks("ops.md", "## `paged_kv_write`")
    exec(compile(code, "docs/ops.md", "exec"), {})


def test_caches_allocation_example_gives_the_commented_shape():
    (code,) = _python_blocks("caches.md")
    scope: dict = {}
    exec(compile(code, "docs/caches.md", "exec"), scope)
    shape = re.search(r"conv\.kv_cache\.shape\s+# \(([\d, ]+)\)", code).group(1)
    assert tuple(scope["conv"].kv_cache.shape) == tuple(int(n) for n in shape.split(","))


def test_first_models_example_runs_a_step():
    code = _python_blocks("models.md")[0]
    scope: dict = {}
    exec(compile(code, "docs/models.md", "exec"), scope)
    assert tuple(scope["out"].shape) == (10, 64)


def test_compiling_example_reruns_the_first_examples_step():
    first, compiling = _python_blocks("models.md")[0], _python_blocks("models.md", "## Compiling")[0]
    scope: dict = {}
    exec(compile(first, "docs/models.md", "exec"), scope)
    eager = scope["out"]
    exec(compile(compiling, "docs/models.md", "exec"), scope)
    assert tuple(scope["out"].shape) == (16, 64)
    tol = TOLERANCES["model_vs_recompute"]  # the same step compiled by Inductor: other sum orders
    torch.testing.assert_close(scope["out"][:10], eager, atol=tol.atol, rtol=tol.rtol)
