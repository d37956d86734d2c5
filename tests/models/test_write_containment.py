"""Memory safety of whole model steps: a step writes no byte outside the rows its own tokens own.

Every cache byte (each layer's whole allocator buffer, the gaps between strided blocks included, and the
Step5 summary caches) is poisoned with random bytes, and around every :class:`StepRunner` step the test
compares all of them. The bytes a step may change are derived from the schedule alone, never from the
metadata the model builds from it (a bug there must show): for each scheduled request ``(slot, start, n)``
the runner's own block tables (``request slot -> blocks``, ``runner._tables``) and the positions
``start .. start + n - 1`` give

- every attention layer's KV cache ``[num_blocks, N, H, K + V]``: the whole token row
  ``kv[table[slot, p // N], p % N]`` of each position (``N`` is the layer's own bound block size);
- every Step5 CSA tail ring: ring row ``p % capacity`` of the request's ring block, for the request's last
  ``capacity`` positions of the step only (``csa_ring_update``: earlier ones share a row and are not
  stored), at byte ``block * block_stride + row * 1024``; ``capacity`` is the page (``N * 1 * head_size``
  bf16) over 1024-byte rows, so the rows between a strided block's ring and the next block are never allowed;
- every Step5 summary cache: the slot ``summary_table[slot, g // S] * S + g % S`` of each region ``g``
  that a position ``p = 8 g + 7`` of the step closes;
- every Inkling conv-state cache ``[num_blocks, H, N, D]``: the four streams ``[0, 2 hd + 2 hph)`` of each
  head at ``cache[conv_table[slot, p // N], :, p % N]`` (never the power-of-two padding of ``D``).

Padding tokens (each step pads to a capture size; their slot is -1) therefore may write nothing. The
schedule covers chunked ragged prefill (chunks longer than a ring's capacity), decode, verify steps with
rejected drafts (rewritten by the next step), requests that finish while others go on, and new requests
that reuse a finished request's slot, i.e. its blocks, over stale contents. Every step must also change
something (the check is not vacuous). The CPU kernels run by default; one small run points the ops' CPU
dispatch at the Triton launchers (under ``TRITON_INTERPRET=1``), and one per model runs the steps through
the runner's Inductor-compiled forward. tests/models/test_tensor_parallel.py runs the same check in each
tensor-parallel rank (:func:`run_contained_steps`).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from stepops._triton import interpreting
from stepops.layouts import ROW_BYTES
from stepops.models import InklingConfig, InklingModel, Step5Config, Step5Model
from stepops.models.inkling import DENSE
from stepops.models.runner import COMPILED, EAGER, ScheduledRequest, StepRunner, Workload, run_workload
from stepops.testing import storage_bytes

_REGION = 8


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _mark(allowed: torch.Tensor, cache: torch.Tensor, index: tuple) -> None:
    """Set ``allowed`` (uint8 over the bytes of ``cache``'s storage) to 1 on every byte of ``cache[index]``.

    ``cache``'s own shape, strides and offset (the allocator's layout) place the elements; the marks go
    through an integer view of the same element size, so every byte of a marked element is marked.
    """
    as_int = allowed.view(_INT_OF_SIZE[cache.element_size()])
    view = as_int.as_strided(cache.shape, cache.stride(), cache.storage_offset())
    view[index] = -1 if cache.element_size() > 1 else 255


class Geometry:
    """What each cache of ``model`` holds, read from the bound caches' shapes and the config only."""

    def __init__(self, model) -> None:
        self.model = model
        self.step5 = isinstance(model, Step5Model)
        self.caches: list[torch.Tensor] = []  # one tensor per storage
        self.attn = []  # (kv_cache,)
        self.rings = []  # (kv_cache [nb, N, 1, head_size], capacity, block_stride_bytes)
        self.summaries = []  # summary caches [slots, 256] uint8
        self.convs = []  # (kv_cache [nb, H, N, D], used width)
        for layer in model.layers:
            self.attn.append(layer.attn.kv_cache)
            if self.step5 and layer.kind == "csa":
                ring = layer.csa_ring.kv_cache
                page = ring.shape[1] * ring.shape[2] * ring.shape[3] * ring.element_size()
                self.rings.append((ring, page // ROW_BYTES, ring.stride(0) * ring.element_size()))
                self.summaries.append(layer.summary_cache)
            if not self.step5:
                cfg = model.config
                _, kv_heads, head_dim = cfg.attention_geometry(cfg.layer_types[len(self.convs)])
                # K, V, then the attention- and MLP-output chunks of ceil(hidden / kv_heads) channels: with KV
                # heads that do not divide hidden_size the last head's chunk is padded with zero channels.
                self.convs.append((layer.conv_state.kv_cache, 2 * head_dim + 2 * -(-cfg.hidden_size // kv_heads)))
        self.caches = self.attn + [r[0] for r in self.rings] + self.summaries + [c[0] for c in self.convs]
        assert len({c.untyped_storage().data_ptr() for c in self.caches}) == len(self.caches)

    def allowed(self, tables: dict[str, torch.Tensor], batch) -> dict[int, torch.Tensor]:
        """Storage pointer -> uint8 mask of the bytes the step ``batch`` may change."""
        masks = {c.untyped_storage().data_ptr(): torch.zeros_like(storage_bytes(c)) for c in self.caches}

        def mask(cache):
            return masks[cache.untyped_storage().data_ptr()]

        for s in batch:
            n = len(s.inputs)
            positions = range(s.start, s.start + n)
            for kv in self.attn:
                block_size, table = kv.shape[1], tables["attn"][s.slot]
                for p in positions:
                    if p // block_size < table.numel() and table[p // block_size] >= 0:
                        _mark(mask(kv), kv, (int(table[p // block_size]), p % block_size))
            for ring, capacity, stride in self.rings:
                block = int(tables["ring"][s.slot])
                ring_bytes = mask(ring)
                for p in positions[max(0, n - capacity) :]:  # only the last `capacity` positions store
                    first = block * stride + (p % capacity) * ROW_BYTES
                    ring_bytes[first : first + ROW_BYTES] = 1
            for summary in self.summaries:
                per_block, table = self.model.summary_block_size, tables["summary"][s.slot]
                for g in (p // _REGION for p in positions if p % _REGION == _REGION - 1):  # regions closed
                    if g // per_block < table.numel() and table[g // per_block] >= 0:
                        _mark(mask(summary), summary, (int(table[g // per_block]) * per_block + g % per_block,))
            for conv, width in self.convs:
                block_size, table = conv.shape[2], tables["conv"][s.slot]
                for p in positions:
                    if p // block_size < table.numel() and table[p // block_size] >= 0:
                        block = int(table[p // block_size])
                        _mark(mask(conv), conv, (block, slice(None), p % block_size, slice(0, width)))
        return masks


class ContainmentChecker:
    """Wraps ``runner.step``: poisons every cache once, then checks every step's changed bytes."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self.geometry = Geometry(runner.model)
        self.tables = {name: t.clone() for name, t in runner._tables.items()}  # the schedule's block tables
        gen = torch.Generator().manual_seed(1234)
        for cache in self.geometry.caches:  # random bytes: a write of anything shows
            raw = storage_bytes(cache)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        self.params = {name: t.detach().clone() for name, t in runner.model.state_dict().items()}
        self._step = runner.step
        runner.step = self.step
        self.steps = self.padded_steps = 0

    def step(self, batch):
        before = {c.untyped_storage().data_ptr(): storage_bytes(c).clone() for c in self.geometry.caches}
        allowed = self.geometry.allowed(self.tables, batch)
        out = self._step(batch)
        total = sum(len(s.inputs) for s in batch)
        self.steps += 1
        self.padded_steps += self.runner.padded_size(total) > total
        for cache in self.geometry.caches:
            ptr = cache.untyped_storage().data_ptr()
            changed = storage_bytes(cache) != before[ptr]
            if total and not changed.any() and not any(cache is summary for summary in self.geometry.summaries):
                # Every real token writes every KV cache, ring and conv state: the check is not vacuous.
                raise AssertionError(f"step {self.steps} wrote nothing into {self._name(cache)}")
            outside = (changed & (allowed[ptr] == 0)).nonzero().flatten()
            if outside.numel():
                name = self._name(cache)
                raise AssertionError(
                    f"step {self.steps} ({[(s.slot, s.start, len(s.inputs)) for s in batch]}) wrote "
                    f"{outside.numel()} bytes outside its rows in {name}: first byte offsets "
                    f"{outside[:8].tolist()} (cache shape {tuple(cache.shape)}, strides {cache.stride()})"
                )
        return out

    def _name(self, cache) -> str:
        for name, owner in self.runner.model.static_forward_context.items():
            if getattr(owner, "kv_cache", None) is cache:
                return name
        return "a summary cache"

    def check_parameters(self) -> None:
        for name, t in self.runner.model.state_dict().items():
            assert torch.equal(t, self.params[name]), f"a step changed parameter {name}"


_WORKLOAD = Workload(prompt_lens=(19, 9, 13), decode_lens=(6, 11, 4), num_speculative_tokens=3, token_budget=16)
_LONG = Workload(prompt_lens=(84, 9), decode_lens=(7, 5), num_speculative_tokens=3, token_budget=32)


def _model(kind: str, config=None):
    torch.manual_seed(0)
    if kind == "step5":
        return Step5Model(config or Step5Config())
    return InklingModel(config or InklingConfig())


def run_contained_steps(
    model, workload: Workload | None = _WORKLOAD, *, first_chunk: int = 5, mode: str = EAGER
) -> ContainmentChecker:
    """Run ``workload`` and then new requests in finished slots (their blocks, stale contents); without a
    workload, three small steps whose first chunk of request 0 is ``first_chunk`` tokens long. Every step
    goes through a :class:`ContainmentChecker`; ``mode`` is the runner's (eager or compiled). The inputs are
    seeded, so every tensor-parallel rank runs the same steps."""
    k = model.config.num_speculative_tokens
    budget = workload.token_budget if workload else first_chunk + 2  # the first step is padded
    max_len = max(24, workload.max_len if workload else 0) + 2 * k
    runner = StepRunner(
        model, max_requests=3, max_model_len=max_len, max_tokens=budget, device="cpu", seed=3, mode=mode
    )
    checker = ContainmentChecker(runner)
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(7)

    def x(n):
        return torch.randn(n, hidden, generator=gen).to(torch.bfloat16)

    with torch.inference_mode():
        if workload is not None:
            workload = Workload(**{**workload.__dict__, "num_speculative_tokens": k})
            result = run_workload(runner, workload, hidden)
            assert result.verify_turns > 0 and result.rejected_tokens > 0  # verify steps rejected drafts
            # Every request has finished: new ones take slots 0 and 2 from position 0, ragged, then decode
            # and verify steps, each padded up to a capture size.
            runner.step([ScheduledRequest(2, 0, x(13)), ScheduledRequest(0, 0, x(3))])
            runner.step([ScheduledRequest(0, 3, x(1 + k)), ScheduledRequest(2, 13, x(2))])  # verify + prefill end
            runner.step([ScheduledRequest(0, 4, x(1))])  # slot 0's drafts rejected: position 4 rewritten
            runner.step([ScheduledRequest(2, 15, x(1 + k)), ScheduledRequest(0, 5, x(1))])  # 15 closes a region
            runner.step([])  # padding only
        else:  # a few small steps (the Triton kernels are slow under the interpreter)
            f = first_chunk
            runner.step([ScheduledRequest(0, 0, x(f)), ScheduledRequest(1, 0, x(1))])  # ragged prefill
            runner.step([ScheduledRequest(0, f, x(1 + k)), ScheduledRequest(1, 1, x(1))])  # verify, padded
            # One draft of request 0 accepted, the rest rewritten by another verify step; request 1 is done
            # and a new one takes its blocks from position 0.
            runner.step([ScheduledRequest(0, f + 1, x(1 + k)), ScheduledRequest(1, 0, x(1))])
    checker.check_parameters()
    assert checker.padded_steps > 0
    return checker


@pytest.mark.parametrize(
    "kind, config, workload",
    [
        pytest.param("step5", None, None, id="step5"),
        pytest.param("step5", Step5Config(layer_types=("csa",), moe_layers=(), num_speculative_tokens=2), None, id="step5_csa_k2"),
        # A request of 91 tokens: its positions cross the 80-token attention block into its second block.
        pytest.param("step5", Step5Config(layer_types=("csa",), moe_layers=()), _LONG, id="step5_csa_long"),
        pytest.param("inkling", None, None, id="inkling"),
        pytest.param("inkling", InklingConfig(layer_types=("global",), block_size=32), None, id="inkling_enlarged_blocks"),
        # 3 KV heads for 64 channels: chunks of 22, the last head's 2 padding channels written (as zeros).
        pytest.param("inkling", InklingConfig(layer_types=("global",), num_heads=6, num_kv_heads=3), None,
                     id="inkling_padded_head_chunks"),
    ],
)
def test_a_step_writes_only_its_own_rows(kind, config, workload):
    checker = run_contained_steps(_model(kind, config), workload or _WORKLOAD)
    assert checker.steps > 10


@pytest.mark.parametrize(
    "kind, config",
    [
        pytest.param("step5", Step5Config(layer_types=("csa",), moe_layers=()), id="step5_csa"),
        pytest.param("inkling", InklingConfig(layer_types=("global",), mlp_layer_types=(DENSE,)), id="inkling"),
    ],
)
def test_a_compiled_step_writes_only_its_own_rows(kind, config):
    """The same steps through the runner's Inductor-compiled forward (``torch.compile(fullgraph=True)``,
    what users run). Functionalisation turns each cache op into an out-of-place op on its whole base, and
    Inductor puts it back in place (or clones and copies back), passing the op views it regenerates from
    the base; it also compiles the metadata arithmetic (slots of padding tokens included) into its own
    kernels. A wrong view, a copy-back of anything but the op's result, or a padding slot that is not -1
    writes outside the allowed rows. (A copy-back of unchanged bytes cannot show here: test_compile's
    Inductor test checks the code for clones and copies into the caches.)

    One layer of each model (it has every cache kind: KV, ring and summary; KV and conv state) and no MoE:
    the smallest graph, compiled once per model and reused by every step. ``aot_eager`` would compile in
    a few seconds, but it runs each op on a clone of its whole base and copies the base back: eager's
    writes again, none of Inductor's in-place code or kernels.
    """
    counters.clear()
    checker = run_contained_steps(_model(kind, config), mode=COMPILED)
    assert checker.steps > 10
    assert counters["stats"]["unique_graphs"] == 1  # every step ran the one compiled graph


@contextlib.contextmanager
def _triton_kernels_on_cpu():
    """Dispatch the three cache ops' CPU calls to their Triton launchers (interpreted on CPU)."""
    from stepops.ops.csa_ring_update.triton_kernel import csa_ring_update_triton
    from stepops.ops.paged_kv_write.triton_kernel import paged_kv_write_triton
    from stepops.ops.sconv.triton_kernel import sconv_triton

    lib = torch.library.Library("stepops", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            # allow_override stated: torch 2.13 defaults it to True, torch 2.11 to False (a RuntimeError).
            for name, launcher in (
                ("paged_kv_write", paged_kv_write_triton), ("sconv", sconv_triton), ("csa_ring_update", csa_ring_update_triton)
            ):
                lib.impl(name, launcher, "CPU", allow_override=True)
        yield
    finally:
        lib._destroy()  # the PyTorch kernels are the CPU kernels again


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the models run the Triton kernels already")
@pytest.mark.parametrize(
    "kind, config, first_chunk",
    [
        # k = 3 and capacity 10 = 7 + k: a first chunk of 14 tokens (> capacity), a verify step at 14..17
        # (15 closes a region inside it) and one at 15..18 whose first token closes a region while row 18
        # lands on the row of position 8, which that region's replay reads.
        pytest.param("step5", Step5Config(layer_types=("csa",), moe_layers=()), 14, id="step5_csa"),
        pytest.param("inkling", InklingConfig(layer_types=("global",), num_speculative_tokens=2), 5, id="inkling"),
    ],
)
def test_a_step_writes_only_its_own_rows_with_the_triton_kernels(kind, config, first_chunk):
    pytest.importorskip("triton")
    if not interpreting():
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    with _triton_kernels_on_cpu():
        checker = run_contained_steps(_model(kind, config), None, first_chunk=first_chunk)
    k = checker.runner.model.config.num_speculative_tokens
    assert all(capacity == 7 + k for _, capacity, _ in checker.geometry.rings)  # as the comment above says
