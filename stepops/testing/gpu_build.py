"""Build every stepops Triton kernel for real GPUs on a CPU-only machine and read what the hardware gets.

For each op, each sample input is pushed through the op's Triton launcher with ``JITFunction.run``
replaced by a recorder, so the launcher picks its grid and constexpr configuration exactly as it would on
a GPU, and Triton's own binder derives the argument signature and specialisations (pointer alignment,
divisibility) from the real sample tensors: no hand-kept signature lists. Every distinct configuration
is then compiled with ``triton.compile`` for sm_90a and sm_80, and the ``cuobjdump``/``nvdisasm`` shipped
in the Triton wheel report registers, stack, local memory (spills), shared memory, the width of every
global load and store in the SASS, and the longest chain of dependent global loads (:func:`load_chains`, a
dataflow analysis of the SASS): on a decode step, where a kernel moves a few KiB, memory round trips in
turn decide its time, not bytes.

Besides the samples (small, odd shapes that reach every code path), callers pass the model-shape calls
they care about (:class:`OpCall`; ``python -m benchmarks static`` passes the benchmarks' decode steps): a
kernel compiled at P = 256 is not the kernel compiled at P = 16.

Must run in a process without ``TRITON_INTERPRET`` (interpreted kernels cannot be compiled):
``python -m stepops.testing.gpu_build`` prints the samples' table; ``python -m benchmarks static`` adds the
decode shapes and estimates, and ``tests/test_gpu_build.py`` runs that in a subprocess, snapshots the
table and bounds each kernel's round trips.

A launcher may allow spills or a stack for one of its kernels with a comment in its own source:
``# gpu-build: allow-spill <kernel_name>: <why>``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from stepops._triton import interpreting

# (name, compute capability): Hopper (H100/H200) and Ampere (A100).
TARGETS = (("sm_90a", 90), ("sm_80", 80))

# One Hopper SM: the limits the occupancy estimate uses (CUDA occupancy calculator, cc 9.0).
_SM90_REGISTERS = 65536
_SM90_MAX_WARPS = 64
_SM90_MAX_BLOCKS = 32
_SM90_SHARED_BYTES = 228 * 1024
_REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256

ALLOW_SPILL = re.compile(r"#\s*gpu-build:\s*allow-spill\s+(\w+):\s*\S")


@dataclass(frozen=True)
class KernelBuild:
    """One compiled kernel configuration and what the compiler made of it."""

    op: str
    kernel: str
    config: str  # constexprs and launch options, e.g. "BLOCK_D=256 warps=4"
    target: str
    registers: int
    stack: int
    local_bytes: int
    shared_bytes: int
    num_warps: int
    global_loads: str  # e.g. "128x2 32x1": load widths in bits x count
    global_stores: str
    barriers: int  # BAR.SYNC in the SASS: a kernel that orders reads before stores must keep its barrier
    spill_allowed: bool
    shapes: str = "samples"  # "samples", or the workload the configuration was reached by
    load_round_trips: int = 0  # see load_chains
    load_address_chain: int = 0

    @property
    def occupancy(self) -> float:
        """Fraction of an H100/H200 SM's warp slots these resources allow."""
        per_warp = -(-max(self.registers, 1) * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
        blocks = min(_SM90_MAX_BLOCKS, (_SM90_REGISTERS // per_warp) // self.num_warps)
        if self.shared_bytes:
            blocks = min(blocks, _SM90_SHARED_BYTES // self.shared_bytes)
        return min(blocks * self.num_warps, _SM90_MAX_WARPS) / _SM90_MAX_WARPS

    @property
    def problems(self) -> list[str]:
        if (self.local_bytes or self.stack) and not self.spill_allowed:
            return [f"{self.kernel} [{self.config}] on {self.target}: stack {self.stack} B, local "
                    f"{self.local_bytes} B (spills) with no '# gpu-build: allow-spill {self.kernel}: why' "
                    "comment at its launcher"]
        return []


@dataclass(frozen=True)
class OpCall:
    """One call of an op at shapes worth compiling for, besides its samples (CPU tensors are enough: the
    kernels are compiled, never run)."""

    op: str
    shapes: str  # a name for the table, e.g. "decode_r256"
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class _Launch:
    op: str
    launcher: object
    fn: object  # triton JITFunction
    args: tuple
    kwargs: dict
    shapes: str = "samples"


def _record_launches(calls: tuple[OpCall, ...] = (), samples: bool = True) -> list[_Launch]:
    """Run every sample (unless ``samples`` is off), then every call in ``calls``, through its op's Triton
    launcher, recording kernel launches instead of running them."""
    from triton.runtime.jit import JITFunction

    from stepops._library import registered_ops
    from stepops.ops.triton_launch import plain_launches
    from stepops.testing.registry import op_samples

    launches: list[_Launch] = []
    current: dict[str, object] = {}

    def record(fn, *args, grid, warmup, **kwargs):
        launches.append(_Launch(current["op"], current["launcher"], fn, args, kwargs, current["shapes"]))

    entries = {entry.name: entry for entry in registered_ops()}
    every = (
        [(name, "samples", args, kwargs) for name in entries for _, args, kwargs in op_samples(op_name=name)]
        if samples
        else []
    )
    every += [(c.op, c.shapes, c.args, c.kwargs) for c in calls]
    original = JITFunction.run
    # Every launch through the recorder: no GPU driver is asked for a device, no compiled kernel kept.
    JITFunction.run = record
    try:
        with plain_launches():
            for name, shapes, args, kwargs in every:
                current.update(op=name, launcher=entries[name].triton_kernel, shapes=shapes)
                entries[name].triton_kernel(*args, **kwargs)
    finally:
        JITFunction.run = original
    return launches


def _bits(op: str) -> int:
    widths = re.findall(r"\.(128|64|U16|S16|U8|S8)\b", op)
    return {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}[widths[0]] if widths else 32


def _access_widths(sass: str, opcode: str) -> str:
    counts: dict[int, int] = {}
    for match in re.finditer(rf"\b{opcode}(\.[A-Z0-9.]+)?\b", sass):
        width = _bits(match.group(0))
        counts[width] = counts.get(width, 0) + 1
    return " ".join(f"{w}x{n}" for w, n in sorted(counts.items(), reverse=True)) or "-"


# ---------------------------------------------------------------------------------------------------------
# Dependent global loads in the SASS
# ---------------------------------------------------------------------------------------------------------

_INSTRUCTION = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@(!?U?P[T0-9])\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):", re.MULTILINE)
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
# A register operand: R, UR (32-bit), P, UP (predicates), PR (all predicates); ".64" names a pair.
_REGISTER = re.compile(r"(?<![\w.])(U?R\d+|U?P\d|PR)(\.64)?(?![\w])")
_GLOBAL_LOADS = {"LDG", "LD"}
_NO_DESTINATION = {"ST", "STG", "STS", "STL", "RED", "REDG", "BRA", "BRX", "JMP", "BAR", "EXIT", "CALL", "RET",
                   "BSSY", "BSYNC", "WARPSYNC", "NOP", "DEPBAR", "MEMBAR", "ERRBAR", "CCTL", "YIELD", "BPT",
                   "KILL", "FENCE"}
# Compare instructions write two predicates first.
_TWO_PREDICATE_DESTINATIONS = {"ISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "PLOP3", "UISETP", "UPLOP3"}
# Integer adds that may write carry-out predicates right after their destination register.
_CARRY_OUT = {"IADD3", "UIADD3", "LEA", "ULEA", "IMAD", "UIMAD", "IADD", "IADD32I"}
# Opcodes whose R operands are 64-bit register pairs.
_DOUBLE = {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DSET"}
# A loop whose loads depend on the previous iteration's would never settle: depths stop here.
_MAX_DEPTH = 64


@dataclass(frozen=True)
class _Instruction:
    opcode: str  # "LDG.E.64"
    guard: tuple[str, ...]  # the predicate register of "@P0" / "@!P0", if any
    destinations: tuple[str, ...]
    sources: tuple[str, ...]
    branch_target: str | None  # BRA/CALL label
    index: int

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def _registers(operand: str, width: int = 1) -> list[str]:
    """Registers an operand names; an R or UR register stands for ``width`` consecutive ones (2 for ``.64``)."""
    names = []
    for match in _REGISTER.finditer(operand):
        name, pair = match.groups()
        if name == "PR":
            names += [f"P{i}" for i in range(7)]
        elif "R" in name:
            prefix, number = name.rstrip("0123456789"), int(name.lstrip("UR"))
            names += [f"{prefix}{number + k}" for k in range(max(width, 2 if pair else 1))]
        else:
            names.append(name)
    return names


def _destination_width(opcode: str) -> int:
    """32-bit registers written by the first destination operand."""
    base = opcode.split(".")[0]
    if base in ("LDG", "LD", "LDS", "LDC", "ULDC", "LDL"):
        return max(1, _bits(opcode) // 32)
    if ".WIDE" in opcode or ".64" in opcode or base in _DOUBLE or opcode.startswith(("F2F.F64", "I2F.F64")):
        return 2
    return 1


def _parse_sass(sass: str) -> tuple[list[_Instruction], dict[str, int]]:
    """Instructions in address order and each label's instruction index."""
    instructions: list[_Instruction] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        match = _INSTRUCTION.search(line)
        if not match:
            continue
        guard, opcode, operand_text = match.groups()
        base = opcode.split(".")[0]
        target = _BRANCH_TARGET.search(operand_text)
        operands = [o.strip() for o in _BRANCH_TARGET.sub("", operand_text).split(",") if o.strip()]
        n_dest = 0
        if base not in _NO_DESTINATION and operands:
            n_dest = 2 if base in _TWO_PREDICATE_DESTINATIONS else 1
            if base in _CARRY_OUT:
                while n_dest < len(operands) and re.fullmatch(r"U?P[T0-6]", operands[n_dest]):
                    n_dest += 1
        destinations = _registers(operands[0], _destination_width(opcode)) if n_dest else []
        destinations += [r for operand in operands[1:n_dest] for r in _registers(operand)]
        sources = [r for operand in operands[n_dest:] for r in _registers(operand, 2 if base in _DOUBLE else 1)]
        guard_register = (guard.lstrip("!"),) if guard and guard.lstrip("!") not in ("PT", "UPT") else ()
        instructions.append(_Instruction(opcode, guard_register, tuple(destinations), tuple(sources),
                                         target.group(1) if target else None, len(instructions)))
    return instructions, labels


@dataclass
class _State:
    """At a point of the program: per register, the memory round trips before its value exists (``trips``)
    and the longest chain of loads its value derives from through addresses (``chain``); ``now``, the round
    trips the warp has waited for so far; ``loaded``, the deepest load issued so far."""

    trips: dict[str, int]
    chain: dict[str, int]
    now: int = 0
    loaded: int = 0

    def merge(self, other: "_State") -> bool:
        changed = False
        for mine, theirs in ((self.trips, other.trips), (self.chain, other.chain)):
            for register, depth in theirs.items():
                if depth > mine.get(register, 0):
                    mine[register] = depth
                    changed = True
        for name in ("now", "loaded"):
            if getattr(other, name) > getattr(self, name):
                setattr(self, name, getattr(other, name))
                changed = True
        return changed

    def copy(self) -> "_State":
        return _State(dict(self.trips), dict(self.chain), self.now, self.loaded)


@dataclass(frozen=True)
class LoadChains:
    """``round_trips``: global-memory round trips one thread waits for in turn, the SASS issued in order;
    ``address_chain``: the longest chain of global loads whose address (or predicate) derives from an
    earlier load's value. 0 for a kernel without global loads."""

    round_trips: int
    address_chain: int


def load_chains(sass: str) -> LoadChains:
    """Dependent global loads of a kernel's SASS, by a forward dataflow analysis over its control flow.

    A warp issues in order and waits only when an instruction reads a register (or predicate) that a
    pending load writes. So each register carries the number of memory round trips before its value
    exists; an instruction issues once its operands exist and no earlier than the instruction before it; a
    load's value exists one round trip after it issues. ``BAR.SYNC`` is taken to wait for every load issued
    before it (a barrier that orders reads before other threads' stores must). Along the way, each register
    also carries the longest chain of loads its value derives from (a load's address or predicate from an
    earlier load's destination): ``address_chain``. Paths merge by maximum; a predicated instruction may
    keep its destination's old value; calls are followed into the callee. Every wait counts as a full round
    trip, even for a load issued long before or one that hits in L1/L2: ``round_trips`` is an upper bound.
    """
    instructions, labels = _parse_sass(sass)
    if not instructions:
        return LoadChains(0, 0)
    starts = sorted({0, *labels.values(), *(i.index + 1 for i in instructions
                                           if i.base in ("BRA", "BRX", "JMP", "EXIT", "RET", "CALL"))})
    starts = [s for s in starts if s < len(instructions)]
    block_of = {start: n for n, start in enumerate(starts)}
    ends = starts[1:] + [len(instructions)]

    def successors(n: int) -> list[int]:
        last = instructions[ends[n] - 1]
        out = []
        if last.branch_target in labels and labels[last.branch_target] < len(instructions):
            out.append(block_of[labels[last.branch_target]])
        # A branch is conditional when guarded or given a predicate ("BRA !P6, `(.L_x_1)"); EXIT and RET
        # when guarded. RET returns to the caller, which the analysis has already continued past the CALL.
        conditional = bool(last.guard) or (last.base != "RET" and any("P" in r for r in last.sources))
        if (last.base not in ("BRA", "BRX", "JMP", "EXIT", "RET") or conditional) and ends[n] < len(instructions):
            out.append(n + 1)
        return out

    entry: dict[int, _State] = {0: _State({}, {})}
    pending = [0]
    round_trips = address_chain = 0
    while pending:
        n = pending.pop()
        state = entry[n].copy()
        for instruction in instructions[starts[n]:ends[n]]:
            operands = instruction.sources + instruction.guard
            ready = max((state.trips.get(r, 0) for r in operands), default=0)
            if instruction.base == "BAR":
                ready = max(ready, state.loaded)
            state.now = min(max(state.now, ready), _MAX_DEPTH)
            chain = max((state.chain.get(r, 0) for r in operands), default=0)
            trips = ready
            if instruction.base in _GLOBAL_LOADS:
                trips, chain = min(state.now + 1, _MAX_DEPTH), min(chain + 1, _MAX_DEPTH)
                state.loaded = max(state.loaded, trips)
                round_trips, address_chain = max(round_trips, trips), max(address_chain, chain)
            for register in instruction.destinations:
                if instruction.guard:  # may not execute: the register may keep its value
                    state.trips[register] = max(trips, state.trips.get(register, 0))
                    state.chain[register] = max(chain, state.chain.get(register, 0))
                else:
                    state.trips[register], state.chain[register] = trips, chain
        for successor in successors(n):
            if successor not in entry:
                entry[successor] = state.copy()
                pending.append(successor)
            elif entry[successor].merge(state):
                pending.append(successor)
    return LoadChains(round_trips, address_chain)


def _nvidia_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _compile(launch: _Launch, target_name: str, capability: int) -> KernelBuild:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = launch.fn
    target = GPUTarget("cuda", capability, 32)
    backend, bound, specialization, options, kwargs = _bind(launch, capability)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    try:
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    except Exception as error:  # report which kernel and configuration failed, then fail
        raise RuntimeError(f"{launch.op}: {fn.__name__} [{_config(fn, constexprs, specialization, options)}] does not compile "
                           f"for {target_name}:\n{error}") from error
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", cubin.name], check=True,
                               capture_output=True, text=True).stdout
        sass = subprocess.run([_nvidia_tool("nvdisasm"), "-c", cubin.name], check=True, capture_output=True,
                              text=True).stdout
    resources = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    chains = load_chains(sass)
    allowed = {m.group(1) for m in ALLOW_SPILL.finditer(inspect.getsource(launch.launcher))}
    return KernelBuild(
        op=launch.op,
        kernel=fn.__name__,
        config=_config(fn, constexprs, specialization, options),
        target=target_name,
        registers=int(resources.get("REG", 0)),
        stack=int(resources.get("STACK", 0)),
        local_bytes=int(resources.get("LOCAL", 0)),
        shared_bytes=max(int(resources.get("SHARED", 0)), int(compiled.metadata.shared)),
        num_warps=options.num_warps,
        global_loads=_access_widths(sass, "LDG"),
        global_stores=_access_widths(sass, "STG"),
        barriers=len(re.findall(r"\bBAR\.SYNC", sass)),
        spill_allowed=fn.__name__ in allowed,
        shapes=launch.shapes,
        load_round_trips=chains.round_trips,
        load_address_chain=chains.address_chain,
    )


def _config(fn, constexprs: dict, specialization: list, options) -> str:
    """The kernel's declared ``tl.constexpr`` values and warps, then (after ``|``) the int arguments Triton
    specialised to the constant 1 (a unit stride, a single column), which also change the code."""
    consts = " ".join(f"{fn.params[path[0]].name}={value}" for path, value in sorted(constexprs.items())
                      if len(path) == 1 and fn.params[path[0]].is_constexpr)
    ones = [p.name for p, (kind, _) in zip(fn.params, specialization) if kind == "constexpr" and not p.is_constexpr]
    return f"{consts} warps={options.num_warps}".strip() + (f" | 1: {','.join(ones)}" if ones else "")


_BINDERS: dict[tuple[object, int], tuple[object, object]] = {}


def _bind(launch: _Launch, capability: int):
    """Triton's own argument binding for ``capability``: (backend, bound args, specialisation, options,
    kwargs). One binder per (kernel, target), as Triton's runtime keeps one per device."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    key = (launch.fn, capability)
    if key not in _BINDERS:
        backend = make_backend(GPUTarget("cuda", capability, 32))
        _BINDERS[key] = backend, create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    backend, binder = _BINDERS[key]
    kwargs = {"debug": False, **launch.kwargs}
    bound, specialization, options = binder(*launch.args, **kwargs)
    return backend, bound, specialization, options, kwargs


def unsupported_reason() -> str | None:
    """Why this Triton cannot run the check (it drives Triton's compile internals), or None."""
    try:
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError as error:
        return f"Triton {_triton_version()} lacks an API the GPU-build check drives: {error}"
    if not hasattr(JITFunction, "_pack_args"):
        return f"Triton {_triton_version()} has no JITFunction._pack_args (the check is written for 3.8-3.9)"
    return None


def _triton_version() -> str:
    import triton

    return triton.__version__


def _check_can_compile() -> None:
    if interpreting():
        raise RuntimeError("gpu_build needs a process without TRITON_INTERPRET: interpreted kernels cannot "
                           "be compiled")
    reason = unsupported_reason()
    if reason:
        raise RuntimeError(reason)


def build_calls(calls: tuple[OpCall, ...]) -> list[KernelBuild]:
    """Compile every kernel launch of ``calls`` alone (no samples) for every target, in launch order: a
    test's check that given shapes or dtypes compile for a GPU at all."""
    _check_can_compile()
    return [_compile(launch, name, cap) for launch in _record_launches(calls, samples=False) for name, cap in TARGETS]


def build_all(calls: tuple[OpCall, ...] = ()) -> list[KernelBuild]:
    """Compile every distinct (kernel, configuration) reached by the samples and by ``calls``, for every
    target; one row per (shapes, configuration), a configuration compiled once."""
    _check_can_compile()
    seen: dict[tuple, list[str]] = {}
    launches: dict[tuple, _Launch] = {}
    for launch in _record_launches(calls):
        _, _, specialization, _, _ = _bind(launch, TARGETS[0][1])
        key = (launch.op, launch.fn.__name__, repr(specialization), repr(sorted(launch.kwargs.items())))
        launches.setdefault(key, launch)
        if launch.shapes not in seen.setdefault(key, []):
            seen[key].append(launch.shapes)
    builds = [dataclasses.replace(build, shapes=shapes)
              for key, launch in launches.items() for name, cap in TARGETS
              for build in [_compile(launch, name, cap)] for shapes in seen[key]]
    # One row per distinct outcome: samples that differ only in alignment may compile identically.
    unique = {b: None for b in builds}
    return sorted(unique, key=lambda b: (b.op, b.shapes != "samples", b.shapes, b.kernel, b.config, b.target,
                                         b.global_loads))


def format_table(builds: list[KernelBuild]) -> str:
    """One row per build; ``trips``: dependent memory round trips, ``chain``: longest address chain of
    loads (see :func:`load_chains`)."""
    header = ("op", "shapes", "kernel", "config", "target", "regs", "stack", "local", "smem", "occupancy",
              "bar", "trips", "chain", "LDG bits", "STG bits")
    rows = [header] + [
        (b.op, b.shapes, b.kernel, b.config, b.target, str(b.registers), str(b.stack), str(b.local_bytes),
         str(b.shared_bytes), f"{b.occupancy:.0%}", str(b.barriers), str(b.load_round_trips),
         str(b.load_address_chain), b.global_loads, b.global_stores)
        for b in builds
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    """Print the table; ``--json PATH`` also writes every build's fields. Exit 1 on an unexplained spill."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m stepops.testing.gpu_build", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write every build as a JSON list")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    builds = build_all()
    print(format_table(builds))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(b) for b in builds], indent=1))
    problems = [p for b in builds for p in b.problems]
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
