"""A small step runner: caches, fixed-size step buffers, chunked prefill, decode and speculative verify.

:class:`StepRunner` owns one model's caches (each layer its own, through the allocator), a fixed set of
device buffers (:class:`StepBuffers` and a ``[max_tokens, hidden]`` input buffer) and the step function,
run eagerly, compiled (``torch.compile(fullgraph=True)``, one graph for every padded size ``T >= 2``, or
two where an MoE block runs only the chosen experts at small ``T``: see :func:`token_ranges_for`) or
replayed from CUDA graphs (one per capture size). Each step pads its token count up to a capture size
(padding tokens carry ``-1`` and write nothing) and copies the schedule into the fixed buffers; the model
derives every per-token tensor on the device.

:func:`run_workload` drives many requests through prefill chunks, plain decode and verify steps with
random rejections. Rollback needs no undo: the next step's positions count only accepted tokens, so it
rewrites whatever a rejected draft left in the caches. A Step5 model's CSA rings bound how far back
(``Step5Model.max_rollback``, at least ``num_speculative_tokens``); a step that starts further back is a
``ValueError`` (its region replays would read rows a rejected draft overwrote).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import random
import time
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from stepops.layouts import REGION_SIZE
from stepops.models.dtypes import check_built_dtypes
from stepops.models.inkling import InklingModel
from stepops.models.metadata import StepBuffers
from stepops.models.step5 import Step5Model
from stepops.specs import check_ids_in_range, check_int, is_int, is_integer_dtype

EAGER, COMPILED, CUDA_GRAPH = "eager", "compiled", "cudagraph"
HIDDEN, TOKENS = "hidden", "tokens"


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: ``inputs`` (``[n, hidden]``, or ``[n]`` token ids for a runner of
    ``inputs="tokens"``) at positions ``start .. start + n - 1``."""

    slot: int  # the runner's request slot (its block-table row)
    start: int
    inputs: torch.Tensor


def _as_tensor(inputs) -> torch.Tensor:
    """A request's ``inputs`` as a tensor: a tensor as it is, a list on the host (``torch.as_tensor`` alone
    would place both on the caller's default device, if one is set)."""
    return inputs if isinstance(inputs, torch.Tensor) else torch.as_tensor(inputs, device="cpu")


def capture_sizes_for(max_tokens: int) -> tuple[int, ...]:
    """Padded step sizes: powers of two from 2 up to ``max_tokens`` (and ``max_tokens`` itself).

    The smallest is 2, not 1: Dynamo specialises a size of 1, so a ``T = 1`` step would compile a second
    graph; padding a lone decode token to 2 keeps every step on one graph.
    """
    sizes, size = [], 2
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (max(max_tokens, 2),)


def _is_token_id(value: object) -> bool:
    """An integer (Python, NumPy) and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_list(what: str, ids: object) -> list[int]:
    """``ids`` as a list of ints: a flat sequence of integer token ids (a list, or a 1-D integer tensor or
    array); ``TypeError`` naming ``what`` otherwise (floats and bools were truncated into token ids, and a
    string or a nested list failed deep inside torch)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()  # 0-d: one int, refused below; n-d: nested lists, refused below
    if not isinstance(ids, Iterable) or isinstance(ids, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of token ids, got {type(ids).__name__}")
    ids = list(ids)
    not_ids = [i for i in ids if not _is_token_id(i)]
    if not_ids:
        raise TypeError(f"{what}: token ids must be integers, got {type(not_ids[0]).__name__}")
    return [int(i) for i in ids]


def _proposed(
    draft: Callable[[int, list[int]], Sequence[int]], i: int, tokens: list[int], vocab_size: int
) -> list[int]:
    """``draft(i, tokens)`` as a checked list of token ids (``TypeError``/``ValueError`` naming the draft)."""
    what = f"draft({i}, tokens) for prompt {i}"
    proposal = _token_list(what, draft(i, list(tokens)))
    check_ids_in_range(what, proposal, vocab_size, "the vocabulary")
    return proposal


def step_function(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``(hidden, buffers) -> forward(hidden, buffers)`` with a code object of its own, for ``torch.compile``.

    Dynamo keeps compiled graphs, and counts recompiles toward ``torch._dynamo.config.recompile_limit``, per
    code object. Compiling the model itself, every runner compiled its class's one ``forward``, so a process
    that had compiled runners of 8 configs (a sweep, a test session) failed the next one's first step (a hard
    error under ``fullgraph=True``). Each call of this makes a new code object, so a runner's recompile
    limit counts only its own graphs; Dynamo inlines ``forward`` (the model's ``__call__``, hooks
    included). Dynamo's automatic-dynamic bookkeeping is keyed by source location and stays shared.
    """

    def step(hidden: torch.Tensor, buffers: StepBuffers) -> torch.Tensor:
        return forward(hidden, buffers)

    return types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, None, step.__closure__)


def _check_model_device(model: torch.nn.Module, device: torch.device) -> None:
    """``ValueError`` naming the first parameter or buffer of ``model`` that is not on ``device``: another
    device type, or another GPU where ``device`` names one (``cuda:1``; plain ``cuda`` takes any). The
    runner's buffers and caches go to ``device``, and a model elsewhere failed inside its first GEMM (or, for
    ``device="cuda"`` on a CPU build, with torch's assertion)."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        other_gpu = device.type != "cpu" and device.index not in (None, tensor.device.index)
        if tensor.device.type != device.type or other_gpu:
            raise ValueError(
                f"the model's {name} is on {tensor.device}, the runner's device is {device}; move the model "
                f"first (model.to({str(device)!r}))"
            )


def token_ranges_for(model: torch.nn.Module, max_size: int) -> tuple[tuple[int, int], ...]:
    """The ranges ``(min, max)`` of padded step sizes ``2 .. max_size`` that share one compiled graph.

    One range, unless a module of ``model`` takes a path by the step's token count: an MoE block's
    ``small_step_max_tokens`` (:mod:`stepops.models.moe`) splits the sizes after it. Within a range the
    token dimension is dynamic and every branch on it is decided by the range alone; one range across the
    bound would need a guard on the size, which ``mark_dynamic``'s declared range refuses.
    """
    bounds = sorted({m.small_step_max_tokens for m in model.modules() if hasattr(m, "small_step_max_tokens")})
    ranges, low = [], 2
    for bound in bounds:
        if low <= bound < max_size:
            ranges.append((low, bound))
            low = bound + 1
    return tuple(ranges) + ((low, max(max_size, 2)),)


# Inductor keeps the bf16 roundings the models write (``.to(bf16)`` then ``.float()`` inside one fused
# kernel), which it drops by default: Step5's fp8 experts round their GEMM outputs to bf16 and then their
# inputs to e4m3, which turns a dropped rounding into a different code (an MoE output 80% different from
# eager's). Honoured by torch >= 2.13's CPU Inductor (measured: bitwise equal to eager); torch 2.11's ignores it.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


class StepRunner:
    """Runs steps of ``model`` over ``max_requests`` request slots of up to ``max_model_len`` tokens.

    ``mode``: ``"eager"``, ``"compiled"`` (``torch.compile(fullgraph=True)``; ``compile_backend`` picks the
    backend) or ``"cudagraph"`` (CUDA only: one ``torch.cuda.CUDAGraph`` per capture size, captured from
    padding-only steps, which write nothing, all in one memory pool). Every cache block is handed out
    once, in a seeded random order, so block tables are not the identity.

    ``inputs``: ``"hidden"`` steps feed hidden states ``[n, hidden]`` to ``model(hidden, buffers)`` and
    return its outputs; ``"tokens"`` steps feed token ids ``[n]`` to ``model.forward_tokens`` (embedding to
    logits, the whole step compiled or captured as one) and return logits; :meth:`generate` needs it.
    """

    def __init__(
        self,
        model: Step5Model | InklingModel,
        *,
        max_requests: int,
        max_model_len: int,
        max_tokens: int,
        device: torch.device | str,
        mode: str = EAGER,
        compile_backend: str = "inductor",
        seed: int = 0,
        inputs: str = HIDDEN,
    ) -> None:
        if inputs not in (HIDDEN, TOKENS) or (inputs == TOKENS and not hasattr(model, "forward_tokens")):
            raise ValueError(f"inputs must be {HIDDEN!r}, or {TOKENS!r} for a model with forward_tokens, got {inputs!r}")
        if mode not in (EAGER, COMPILED, CUDA_GRAPH):
            raise ValueError(f"mode must be {EAGER!r}, {COMPILED!r} or {CUDA_GRAPH!r}, got {mode!r}")
        if mode == CUDA_GRAPH and torch.device(device).type != "cuda":
            raise ValueError("CUDA-graph mode needs a CUDA device")
        for name, value, minimum in (("max_requests", max_requests, 1), ("max_model_len", max_model_len, 1),
                                     ("max_tokens", max_tokens, 1), ("seed", seed, 0)):  # fmt: skip
            check_int(name, value, minimum)
        _check_model_device(model, torch.device(device))
        check_built_dtypes(model)
        self.model = model
        self.device = torch.device(device)
        self.mode = mode
        self.max_requests = max_requests
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.capture_sizes = capture_sizes_for(max_tokens)
        gen = torch.Generator().manual_seed(seed)

        # The page unifier only ever enlarges block sizes, so sizing the pool by the declared (smallest)
        # block sizes is enough; the tables below use the bound caches' actual sizes.
        declared = [model.config.block_size] + [getattr(model.config, "conv_kernel_size", model.config.block_size)]
        num_blocks = max_requests * -(-max_model_len // min(declared))
        summary_blocks = 1
        if isinstance(model, Step5Model):
            summary_blocks = -(-(max_model_len // REGION_SIZE + 1) // model.summary_block_size)
            model.allocate_caches(num_blocks, max_requests * summary_blocks, self.device)
            conv_blocks = 1
        else:
            model.allocate_caches(num_blocks, self.device)
            conv_blocks = -(-max_model_len // model.conv_block_size)
        attn_blocks = -(-max_model_len // model.attn_block_size)
        # The requests of this runner live in these caches; a later allocation (another runner on the
        # model) replaces them, which _check_caches_bound refuses to step past.
        self._cache_generation = model.cache_generation

        def shuffled(n: int) -> torch.Tensor:  # on the host whatever default device the caller has set
            return torch.randperm(n, generator=gen, device="cpu")

        self._tables = {
            "attn": shuffled(num_blocks)[: max_requests * attn_blocks].view(max_requests, attn_blocks),
            "ring": shuffled(num_blocks)[:max_requests],
            "summary": shuffled(max_requests * summary_blocks).view(max_requests, summary_blocks),
            "conv": shuffled(num_blocks)[: max_requests * conv_blocks].view(max_requests, conv_blocks),
        }
        # The step buffers are views of one int32 device tensor, so that a step's schedule arrives in one
        # host -> device copy (see _fill_buffers).
        shapes = StepBuffers(
            query_start_loc=(max_requests + 1,),
            seq_lens=(max_requests,),
            attn_block_table=(max_requests, attn_blocks),
            ring_blocks=(max_requests,),
            summary_block_table=(max_requests, summary_blocks),
            conv_block_table=(max_requests, conv_blocks),
        )
        numels = [math.prod(shape) for shape in shapes]
        self._schedule = torch.zeros(sum(numels), dtype=torch.int32, device=self.device)
        self.buffers = StepBuffers(*(flat.view(shape) for flat, shape in zip(self._schedule.split(numels), shapes)))
        self.input_kind = inputs
        self._forward: Callable[..., torch.Tensor] = model.forward_tokens if inputs == TOKENS else model
        if inputs == TOKENS:
            self.inputs = torch.zeros(self.capture_sizes[-1], dtype=torch.int64, device=self.device)
        else:
            hidden = model.config.hidden_size
            self.inputs = torch.zeros(self.capture_sizes[-1], hidden, dtype=torch.bfloat16, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # One memory pool for every captured graph (see _warm_up), not a private pool per capture size.
        self._graph_pool = torch.cuda.graph_pool_handle() if mode == CUDA_GRAPH else None
        self._compiled: Callable[..., torch.Tensor] | None = None
        if mode == COMPILED:
            options = INDUCTOR_OPTIONS if compile_backend == "inductor" else None
            self._compiled = torch.compile(
                step_function(self._forward), backend=compile_backend, fullgraph=True, options=options
            )
        self.token_ranges = token_ranges_for(model, self.capture_sizes[-1])
        # Per slot: one past the furthest position its request has fed since it started at 0 (rollback check).
        self._max_rollback: int | None = getattr(model, "max_rollback", None)
        self._fed = [0] * max_requests
        self.steps = 0
        self.tokens = 0

    # -- one step ---------------------------------------------------------------------------------------

    def padded_size(self, num_tokens: int) -> int:
        for size in self.capture_sizes:
            if size >= num_tokens:
                return size
        raise ValueError(f"a step of {num_tokens} tokens exceeds the largest capture size {self.capture_sizes[-1]}")

    def _fill_buffers(self, batch: Sequence[ScheduledRequest]) -> int:
        """Copy the schedule into the fixed device buffers; return the real token count."""
        r = self.max_requests
        if len(batch) > r:
            raise ValueError(f"{len(batch)} requests in one step; the runner has {r} slots")
        # Checked before any buffer is touched: a bad schedule must not leave half a step in the buffers.
        requests_inputs = [self._checked_inputs(s) for s in batch]
        lens = [len(request_inputs) for request_inputs in requests_inputs]
        total = sum(lens)
        if total > self.max_tokens:  # padded_size alone would let max_tokens = 1 run 2 (its padded size)
            raise ValueError(f"a step of {total} tokens exceeds the runner's max_tokens {self.max_tokens}")
        seen: set[int] = set()
        for s in batch:
            # A negative slot would index another slot's block-table row from the end (its pages written).
            if not 0 <= s.slot < r:
                raise ValueError(f"request slot {s.slot} is outside the runner's slots 0..{r - 1}")
            if s.slot in seen:
                raise ValueError(f"request slot {s.slot} is scheduled twice in one step")
            seen.add(s.slot)
            if s.start < 0:
                raise ValueError(f"request slot {s.slot}: start must be >= 0, got {s.start}")
            if s.start > self._fed[s.slot]:
                raise ValueError(
                    f"request slot {s.slot}: start {s.start} skips positions {self._fed[s.slot]}..{s.start - 1}, which "
                    "no step of its request has fed (the slot's caches hold what an earlier request left there); "
                    f"continue at {self._fed[s.slot]} or below, or restart at 0"
                )
            back = self._fed[s.slot] - s.start
            if s.start > 0 and self._max_rollback is not None and back > self._max_rollback:
                raise ValueError(
                    f"request slot {s.slot}: start {s.start} steps back {back} positions from {self._fed[s.slot]}, the "
                    f"furthest its steps have fed; the model's CSA rings keep {self._max_rollback} (a verify step may "
                    "carry at most num_speculative_tokens drafts); restart the request at 0"
                )
            if s.start + len(s.inputs) > self.max_model_len:
                raise ValueError(f"request slot {s.slot} would grow past max_model_len {self.max_model_len}")
        # Detached: an input that requires grad would make the persistent buffer carry every later step's
        # autograd history (and keep each step's upstream activations alive).
        inputs = torch.cat([request_inputs.detach() for request_inputs in requests_inputs]) if batch else None
        if inputs is not None and self.input_kind == TOKENS:
            self._check_token_ids(batch, requests_inputs, inputs)
        # Built on the host (device="cpu" whatever default device the caller has set), then one copy.
        host = {"dtype": torch.int32, "device": "cpu"}
        qsl = torch.full((r + 1,), total, **host)
        qsl[: len(batch) + 1] = torch.tensor([0] + lens, **host).cumsum(0)
        seq_lens = torch.tensor([s.start + n for s, n in zip(batch, lens)] + [0] * (r - len(batch)), **host)
        slots = torch.tensor([s.slot for s in batch], dtype=torch.long, device="cpu")
        tables = {}
        for name, table in self._tables.items():
            rows = torch.full((r, *table.shape[1:]), -1, **host)
            rows[: len(batch)] = table[slots]
            tables[name] = rows
        schedule = StepBuffers(qsl, seq_lens, tables["attn"], tables["ring"], tables["summary"], tables["conv"])
        # Host -> device copies that do not block: a blocking one is a stream sync on a GPU (the host would
        # wait for the previous step's kernels, once per copy). From pageable memory CUDA stages the source
        # before the call returns, so the host tensors may be freed at once.
        self._schedule.copy_(torch.cat([t.flatten() for t in schedule]), non_blocking=True)
        self.inputs.zero_()
        if inputs is not None:
            self.inputs[:total].copy_(inputs, non_blocking=True)
        return total

    def _checked_inputs(self, s: ScheduledRequest) -> torch.Tensor:
        """``s.inputs`` as a tensor (a list converted once per step); ``TypeError``/``ValueError`` unless ``s``
        has int ``slot`` and ``start`` (bools and floats were taken as ints) and inputs of this runner's kind:
        ``[n, hidden]`` hidden states, or ``[n]`` integer token ids (their range is checked over the whole
        step, :meth:`_check_token_ids`)."""
        for name in ("slot", "start"):
            if not is_int(getattr(s, name)):
                raise TypeError(f"ScheduledRequest.{name} must be an int, got {type(getattr(s, name)).__name__}")
        try:
            inputs = _as_tensor(s.inputs)
        except (TypeError, RuntimeError, ValueError) as error:  # None: "Could not infer dtype of NoneType"
            raise TypeError(f"request slot {s.slot}: inputs must be a tensor, got {type(s.inputs).__name__}") from error
        if inputs.device.type == "meta":
            raise ValueError(f"request slot {s.slot}: inputs are a meta tensor (no data to feed)")
        if self.input_kind == HIDDEN:
            hidden = self.model.config.hidden_size
            if inputs.dim() != 2 or inputs.shape[1] != hidden:
                raise ValueError(
                    f"request slot {s.slot}: inputs must be [n, {hidden}] hidden states, got {tuple(inputs.shape)}"
                )
            if not inputs.dtype.is_floating_point:  # an int, bool or complex tensor was cast into bf16 silently
                raise TypeError(f"request slot {s.slot}: hidden states must be floating point, got {inputs.dtype}")
            return inputs
        if inputs.dim() != 1 or not is_integer_dtype(inputs.dtype):
            raise ValueError(
                f"request slot {s.slot}: inputs must be [n] integer token ids, got {inputs.dtype} {tuple(inputs.shape)}"
            )
        return inputs

    def _check_token_ids(
        self, batch: Sequence[ScheduledRequest], requests_ids: Sequence[torch.Tensor], ids: torch.Tensor
    ) -> None:
        """``ValueError`` naming the first request with an id outside the vocabulary, if the step's ids
        ``ids`` (``requests_ids``, each request's, concatenated) have one; one min/max for the step, only for
        ids on the host (a GPU tensor would sync)."""
        vocab = self.model.config.vocab_size
        if ids.device.type != "cpu" or ids.numel() == 0:
            return
        # int64 first: aminmax has no uint16/32/64 kernel (a uint64 id past int64 wraps negative: refused).
        low, high = (int(v) for v in torch.aminmax(ids.long()))
        if 0 <= low and high < vocab:
            return
        for s, request_ids in zip(batch, requests_ids):  # a bad step: find its request
            if request_ids.numel() == 0:
                continue
            low, high = (int(v) for v in torch.aminmax(request_ids.long()))
            if not (0 <= low and high < vocab):
                raise ValueError(
                    f"request slot {s.slot}: token ids must be in [0, {vocab}) (the vocabulary), got {low}..{high}"
                )

    def _commit_fed(self, batch: Sequence[ScheduledRequest]) -> None:
        """Record the positions a step that ran has fed (a step that raised feeds nothing)."""
        for s in batch:
            end = s.start + len(s.inputs)
            self._fed[s.slot] = end if s.start == 0 else max(self._fed[s.slot], end)

    def _run(self, size: int) -> torch.Tensor:
        hidden = self.inputs[:size]
        if self.mode == CUDA_GRAPH:
            if size not in self._graphs:
                raise RuntimeError(f"no CUDA graph captured for T = {size}: call warm_up() before the first step")
            graph, out = self._graphs[size]
            graph.replay()
            return out
        fn = self._forward
        if self._compiled is not None:
            fn = self._compiled
            # One graph for every capture size of a token range: T is symbolic from the first call on
            # (sizes >= 2 only; see capture_sizes_for), instead of a static graph and a dynamic recompile.
            low, high = next(r for r in self.token_ranges if r[0] <= size <= r[1])
            torch._dynamo.mark_dynamic(hidden, 0, min=low, max=high)
        with torch.inference_mode():
            return fn(hidden, self.buffers)

    def _on_device(self) -> contextlib.AbstractContextManager:
        """``torch.cuda.device(self.device)`` on a GPU: ``_capture``'s stream and graph belong to the
        *current* GPU; a runner on ``cuda:1`` while ``cuda:0`` is current would capture on the wrong one.
        (The ops' Triton launchers switch to their tensors' GPU themselves, ``stepops._triton``; inside this
        guard they need not.)"""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def assume_fed(self, slot: int, length: int) -> None:
        """Let the request in ``slot`` start its next step anywhere up to ``length``, as if steps had fed
        positions ``0 .. length - 1``, without running them: the caches keep whatever they hold there, so
        the outputs mean nothing. For benchmarks that time a step deep into a context without its prefill."""
        check_int("assume_fed: slot", slot, 0)
        if slot >= self.max_requests:
            raise ValueError(f"assume_fed: slot {slot} is outside the runner's slots 0..{self.max_requests - 1}")
        check_int("assume_fed: length", length, 0)
        self._fed[slot] = length

    def step(self, batch: Sequence[ScheduledRequest]) -> list[torch.Tensor]:
        """Run one step; return each scheduled request's outputs (on the device): ``[n, hidden]``, or
        ``[n, vocab]`` logits when the runner takes token ids (``inputs="tokens"``)."""
        with self._on_device():
            return self._step(batch)

    def _check_caches_bound(self) -> None:
        """``RuntimeError`` once the model's caches are not the ones this runner allocated: its requests'
        context is gone, and its block tables may point past the new caches (a step would read another
        runner's rows, or zeros)."""
        if self.model.cache_generation != self._cache_generation:
            raise RuntimeError(
                "the model's caches were allocated again after this StepRunner was built (another StepRunner "
                "on the same model, or allocate_caches): this runner's requests are gone; step the newest "
                "runner, or build a new one"
            )

    def _step(self, batch: Sequence[ScheduledRequest]) -> list[torch.Tensor]:
        self._check_caches_bound()
        total = self._fill_buffers(batch)
        out = self._run(self.padded_size(total))
        self._commit_fed(batch)
        self.steps += 1
        self.tokens += total
        starts = [0]
        for s in batch:
            starts.append(starts[-1] + len(s.inputs))
        return [out[starts[i] : starts[i + 1]].clone() for i in range(len(batch))]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        draft: Callable[[int, list[int]], Sequence[int]] | None = None,
        stop_tokens: int | Iterable[int] | None = None,
    ) -> list[list[int]]:
        """Greedy decoding: up to ``max_new_tokens`` new token ids for each prompt, all in one ragged batch.

        Prompt ``i`` takes request slot ``i`` (the runner's caches start empty for it). Prompts are prefilled
        in chunks that fit the largest step; then each step feeds every request its last token, and with
        ``draft``, ``draft(i, tokens_so_far)`` proposed next tokens after it (a verify step; cut to the
        step budget, to ``max_new_tokens`` and to a Step5 model's ``max_rollback``, which a rejected draft
        must not exceed): the drafts that equal the greedy choice before them are accepted, the first that
        does not is replaced by that choice, and the rest are rejected (the next step overwrites their cache
        rows). The emitted tokens
        are the same with or without drafts. Argmax over the logits; the first of equal maxima wins (as
        ``torch.argmax``). A request that emits one of ``stop_tokens`` (end-of-sequence ids) stops there:
        its list ends with that token and may be shorter than ``max_new_tokens`` (as ``eos_token_id`` in
        transformers' ``generate``); the others go on. ``None`` stops at the model config's
        ``eos_token_ids`` (a loaded checkpoint's, as transformers' and the reference's ``generate`` default
        to them); ``()`` runs every request to ``max_new_tokens``. Needs ``inputs="tokens"``; reads the
        logits on the host between steps, never inside one.
        """
        if self.input_kind != TOKENS:
            raise ValueError('generate needs a runner built with inputs="tokens"')
        check_int("max_new_tokens", max_new_tokens, 0)
        vocab_size = self.model.config.vocab_size
        if not isinstance(prompts, Iterable) or isinstance(prompts, (str, bytes)):
            raise TypeError(f"prompts must be a sequence of prompts, got {type(prompts).__name__}")
        prompts = [_token_list(f"prompt {i}", p) for i, p in enumerate(prompts)]
        # Checked before any step writes a cache: the last new token is fed only to predict the next.
        # With max_new_tokens 0 nothing is fed.
        needed = [len(p) + max_new_tokens - 1 if max_new_tokens else 0 for p in prompts]
        too_long = [i for i, n in enumerate(needed) if n > self.max_model_len]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"prompt {i} ({len(prompts[i])} tokens) with {max_new_tokens} new tokens needs "
                f"{needed[i]} positions; the runner's max_model_len is {self.max_model_len}"
            )
        if len(prompts) > self.max_requests:
            raise ValueError(f"{len(prompts)} prompts; the runner has {self.max_requests} request slots")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        for i, prompt in enumerate(prompts):  # all before the first step writes a cache
            check_ids_in_range(f"prompt {i}", prompt, vocab_size, "the vocabulary")
        stop = self._stop_token_set(stop_tokens)
        budget = self.max_tokens
        seqs = [list(p) for p in prompts]
        cached = [0] * len(seqs)  # positions of seqs[i] whose inputs the caches hold
        new = [0] * len(seqs)
        stopped = [False] * len(seqs)
        while any(n < max_new_tokens and not done for n, done in zip(new, stopped)):
            batch, plans, room = [], [], budget
            for i, seq in enumerate(seqs):
                pending = seq[cached[i] :]
                if new[i] >= max_new_tokens or stopped[i] or room == 0:
                    continue
                chunk = pending[:room]
                drafts: list[int] = []
                if draft is not None and len(pending) == 1:
                    most = min(room - 1, max_new_tokens - new[i] - 1)
                    if self._max_rollback is not None:  # 0 with a 7-row ring: no drafts at all
                        most = min(most, self._max_rollback)
                    drafts = _proposed(draft, i, seq, vocab_size)[:most]
                room -= len(chunk) + len(drafts)
                ids = torch.tensor(chunk + drafts, dtype=torch.int64, device="cpu")  # host ids: checked, then copied
                batch.append(ScheduledRequest(i, cached[i], ids))
                plans.append((i, len(chunk), len(pending), drafts))
            outs = self.step(batch)
            for (i, fed, pending, drafts), logits in zip(plans, outs):
                if fed < pending:  # a prompt chunk that does not reach the prompt's end predicts nothing
                    cached[i] += fed
                    continue
                choice = logits[fed - 1 :].argmax(-1).tolist()
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
                    accepted += 1
                emitted = choice[: accepted + 1][: max_new_tokens - new[i]]
                ends = [k for k, token in enumerate(emitted) if token in stop]
                if ends:  # the tokens after a stop token (accepted drafts) are not emitted
                    emitted, stopped[i] = emitted[: ends[0] + 1], True
                seqs[i].extend(emitted)
                new[i] += len(emitted)
                cached[i] = len(seqs[i]) - 1
        return [seq[len(p) :] for seq, p in zip(seqs, prompts)]

    def _stop_token_set(self, stop_tokens: int | Iterable[int] | None) -> frozenset[int]:
        """``generate``'s stop ids as a set (``None``: the config's ``eos_token_ids``), after refusing what is
        not an id or a flat collection of ids, and ids the model cannot emit (past its logits, as Inkling's
        padded vocabulary rows): a stop id that can never fire is a mistake, not a request to run to
        ``max_new_tokens``."""
        config = self.model.config
        if stop_tokens is None:
            return frozenset(config.eos_token_ids)  # checked by the config against its output_vocab_size
        if isinstance(stop_tokens, torch.Tensor):
            stop_tokens = stop_tokens.tolist()  # 0-d: one id; n-d: nested lists, refused below
        if _is_token_id(stop_tokens):  # one id, as transformers' eos_token_id takes it
            stop_tokens = [stop_tokens]
        elif not isinstance(stop_tokens, Iterable) or isinstance(stop_tokens, (str, bytes)):
            raise TypeError(f"stop_tokens must be a token id or a sequence of them, got {type(stop_tokens).__name__}")
        ids = _token_list("stop_tokens", stop_tokens)
        check_ids_in_range("stop_tokens", ids, config.output_vocab_size, "the ids the model can emit")
        return frozenset(ids)

    def warm_up(self, progress: Callable[[str], None] | None = None) -> None:
        """Compile (or capture) every capture size with padding-only steps, which write nothing."""
        with self._on_device():
            self._warm_up(progress)

    def _warm_up(self, progress: Callable[[str], None] | None) -> None:
        self._check_caches_bound()  # a graph captured now would write another runner's caches
        sizes = self.capture_sizes
        if self.mode == CUDA_GRAPH:
            # Largest first, into one shared pool: the largest step's intermediates size the pool and each
            # smaller capture reuses the blocks they free, so the graphs together hold about one step's
            # memory, not the sum over capture sizes. Safe because the runner replays one graph at a time
            # on one stream and no graph reads what another wrote: each reads the inputs, the step buffers
            # and the caches, all allocated outside the pool. A graph's output may share memory with another
            # graph's intermediates, so it holds only until the next replay: step() clones it at once.
            sizes = tuple(reversed(sizes))
        for size in sizes:
            self._fill_buffers([])
            if self.mode == CUDA_GRAPH:
                self._capture(size)
            else:
                self._run(size)
            if progress:
                progress(f"{self.mode}: T = {size} ready")

    def _capture(self, size: int) -> None:
        hidden = self.inputs[:size]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            self._forward(hidden, self.buffers)  # warm-up outside capture (allocator, Triton autotune-free JIT)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool), torch.inference_mode():
            out = self._forward(hidden, self.buffers)
        self._graphs[size] = (graph, out)


# -- the scripted workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Requests with prompts of ``prompt_lens`` that then generate ``decode_lens`` tokens each.

    Per step: prompts are chunked into the ``token_budget``; a decoding request alternates plain decode
    (one token) and verify steps of ``1 + num_speculative_tokens`` tokens with a random number of accepted
    drafts (rejected drafts carry garbage inputs). Seeded.
    """

    prompt_lens: tuple[int, ...] = (21, 9, 35, 14, 3)
    decode_lens: tuple[int, ...] = (12, 18, 9, 15, 20)
    num_speculative_tokens: int = 3
    token_budget: int = 24
    seed: int = 0

    def __post_init__(self) -> None:
        """``TypeError``/``ValueError`` for a workload that cannot run (``token_budget=0`` looped for ever)."""
        if len(self.prompt_lens) != len(self.decode_lens) or not self.prompt_lens:
            raise ValueError(
                f"prompt_lens and decode_lens need one entry per request, at least one; got {len(self.prompt_lens)} "
                f"and {len(self.decode_lens)}"
            )
        for i, (prompt, decode) in enumerate(zip(self.prompt_lens, self.decode_lens)):
            check_int(f"prompt_lens[{i}]", prompt, 1)
            check_int(f"decode_lens[{i}]", decode, 0)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        check_int("token_budget", self.token_budget, 1)
        check_int("seed", self.seed, 0)

    @property
    def lengths(self) -> list[int]:
        """Each request's committed length: its prompt and decoded tokens."""
        return [p + d for p, d in zip(self.prompt_lens, self.decode_lens)]

    @property
    def max_len(self) -> int:
        return max(self.lengths) + self.num_speculative_tokens


@dataclass
class WorkloadResult:
    """Each request's true inputs ``[L, hidden]`` and committed outputs ``[L, hidden]`` (CPU)."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    verify_turns: int = 0  # (request, step) pairs that verified drafts
    rejected_tokens: int = 0


def run_workload(runner: StepRunner, workload: Workload, hidden_size: int) -> WorkloadResult:
    """Drive ``workload`` through ``runner``; return committed outputs per request. Request ``i`` takes
    slot ``i``; a workload with more requests than slots, a request longer than ``max_model_len``, or more
    drafts than a Step5 model's rings roll back, is refused (``ValueError``) before any step."""
    if runner.input_kind != HIDDEN:
        raise ValueError('run_workload feeds hidden states: it needs a runner built with inputs="hidden"')
    n = len(workload.prompt_lens)
    if n > runner.max_requests:
        raise ValueError(f"the workload has {n} requests; the runner has {runner.max_requests} request slots")
    rollback = runner._max_rollback
    if rollback is not None and workload.num_speculative_tokens > rollback:
        raise ValueError(
            f"the workload rejects up to {workload.num_speculative_tokens} drafts per verify step; the model's CSA "
            f"rings roll back {rollback} (Step5Model.max_rollback)"
        )
    if workload.max_len > runner.max_model_len:
        raise ValueError(
            f"the workload needs {workload.max_len} positions per request (its longest request and "
            f"{workload.num_speculative_tokens} drafts); the runner's max_model_len is {runner.max_model_len}"
        )
    rng = random.Random(workload.seed)
    gen = torch.Generator().manual_seed(workload.seed)
    lengths = workload.lengths
    # Host tensors whatever default device the caller has set (the generator is a host one).
    inputs = [torch.randn(length, hidden_size, generator=gen, device="cpu").bfloat16() for length in lengths]
    outputs = [torch.full((length, hidden_size), torch.nan, dtype=torch.bfloat16, device="cpu") for length in lengths]
    committed = [0] * n
    decode_turn = [0] * n
    result = WorkloadResult(inputs, outputs)
    start_time = time.perf_counter()
    steps_before, tokens_before = runner.steps, runner.tokens
    while any(committed[i] < lengths[i] for i in range(n)):
        budget = workload.token_budget
        batch, plans = [], []
        for i in range(n):
            if committed[i] >= lengths[i] or budget == 0:
                continue
            c = committed[i]
            if c < workload.prompt_lens[i]:
                count = min(workload.prompt_lens[i] - c, budget)
                rows, commit = inputs[i][c : c + count], count
            else:
                verify = decode_turn[i] % 2 == 1
                decode_turn[i] += 1
                drafts = min(workload.num_speculative_tokens, budget - 1) if verify else 0
                accepted = rng.randint(0, drafts)
                count = 1 + drafts
                commit = min(1 + accepted, lengths[i] - c)
                truth = inputs[i][c : min(c + count, lengths[i])]
                garbage = torch.randn(count, hidden_size, generator=gen, device="cpu").bfloat16()
                rows = torch.cat([truth[: 1 + accepted], garbage[1 + accepted :]])[:count]
                if rows.shape[0] < count:  # drafts past the request's end: pad with garbage
                    rows = torch.cat([rows, garbage[rows.shape[0] :]])
                if verify:
                    result.verify_turns += 1
                    result.rejected_tokens += count - commit
            budget -= count
            batch.append(ScheduledRequest(i, c, rows))
            plans.append((i, c, commit))
        outs = runner.step(batch)
        for (i, c, commit), out in zip(plans, outs):
            outputs[i][c : c + commit] = out[:commit].cpu()
            committed[i] = c + commit
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    result.seconds = time.perf_counter() - start_time
    result.steps = runner.steps - steps_before
    result.tokens = runner.tokens - tokens_before
    return result
