"""The step shapes every op is measured on: decode, speculative verify (k = 3) and prefill chunks.

A case's ``params`` hold the per-request schedule: ``prior_lens[r]`` tokens already in the caches and
``new_lens[r]`` tokens in this step. Prior lengths are seeded random in ``[16, 1024]``; request 0 always
sits at position 1023 of its sequence in decode and verify steps, so even a one-request step closes a
Step5 region (the costly path of ``csa_ring_update``).
"""

from __future__ import annotations

import random
import zlib

import torch

from benchmarks.harness import Case

VERIFY_TOKENS = 4  # k = 3 draft tokens + the bonus token


def _case(kind: str, prior_lens: list[int], new_lens: list[int]) -> Case:
    requests, tokens = len(new_lens), sum(new_lens)
    name = {"decode": f"decode_r{requests}", "verify": f"verify_k3_r{requests}"}.get(
        kind, f"prefill_{requests}x{new_lens[0]}" + ("_cont" if prior_lens[0] else "")
    )
    return Case(name, kind, requests, tokens, {"prior_lens": prior_lens, "new_lens": new_lens})


def _priors(num_requests: int, first: int) -> list[int]:
    rng = random.Random(num_requests)
    return [first] + [rng.randint(16, 1024) for _ in range(num_requests - 1)]


def decode(num_requests: int) -> Case:
    return _case("decode", _priors(num_requests, 1023), [1] * num_requests)


def verify(num_requests: int) -> Case:
    return _case("verify", _priors(num_requests, 1020), [VERIFY_TOKENS] * num_requests)


def prefill(num_requests: int, chunk: int, prior: int = 0) -> Case:
    return _case("prefill", [prior] * num_requests, [chunk] * num_requests)


def generator(case: Case, salt: str = "") -> torch.Generator:
    """A CPU generator seeded from the case's name, so every build of a case gets the same inputs."""
    return torch.Generator().manual_seed(zlib.crc32((case.name + salt).encode()))


def standard_cases(quick: bool) -> list[Case]:
    """The smallest case first (it also serves the host-cost measurement)."""
    if quick:
        return [decode(1), decode(16), decode(256), verify(16), prefill(1, 256)]
    return [
        *(decode(r) for r in (1, 4, 16, 64, 256)),
        *(verify(r) for r in (1, 16, 64, 256)),
        prefill(1, 512),
        prefill(4, 512, prior=512),
        prefill(1, 2048),
    ]
