"""Decoder names and defaults, once: every entry point (generate, the CLI, the benchmarks, the protocol) reads them.

Method names are one vocabulary everywhere: ``ar`` (greedy full-depth decoding, the baseline of every ratio),
``self-spec`` (sequential self-speculation, RIPE Algorithm 1), ``mature-spec`` (self-speculation with deep K/V
prefix reads, DAS Section 4.1), ``pld`` (prompt lookup decoding) and ``das-wave`` (DAS Section 3.3). The
display names are for tables only.
"""

from __future__ import annotations

METHODS = ("ar", "self-spec", "mature-spec", "pld", "das-wave")
DISPLAY = {"ar": "greedy", "self-spec": "self-spec", "mature-spec": "Mature-Spec", "pld": "prompt lookup",
           "das-wave": "DAS-Wave"}

#: Sequential drafters: d loops per draft, gamma drafts per verification (RIPE Algorithm 1).
DRAFT_LOOPS = 4
BLOCK = 4
#: Prompt lookup: the longest n-gram matched.
NGRAM = 3
#: DAS-Wave: the paper's Huginn configuration (DAS Sec. 4.1, Table 5): gamma 32, J 24, W_init 2, k 2, carried states.
WAVE = {"block": 32, "rounds": 24, "initial_width": 2, "updates": 2, "carry": True}


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method
