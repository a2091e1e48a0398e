"""Streaming: each row's tokens handed over as the decode loop commits them.

:func:`stream` runs :func:`~looped_kv.decoding.generate.generate` with an observer whose
:meth:`~looped_kv.decoding.loop.Observer.emitted` hook queues every commit (the prefill's first token, then each
verification's accepted drafts and the verifier's token), and yields them as they come, while the decoding runs in a
worker thread. Every method, cache, sampling option and ``compile`` is generate's own; an error in the decoding is
raised by the iteration.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence

from torch import Tensor

from looped_kv.decoding.generate import generate
from looped_kv.decoding.loop import Observer
from looped_kv.runtime.model import LoopedLM


class _Handover(Observer):
    """Queues each commit's tokens for the consuming thread."""

    def __init__(self, commits: queue.Queue) -> None:
        self.commits = commits

    def emitted(self, tokens: dict[int, Tensor]) -> None:
        if tokens:
            self.commits.put({row: t.clone() for row, t in tokens.items()})


def stream(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], **options: object) -> Iterator[dict[int, Tensor]]:
    """Decode like :func:`~looped_kv.decoding.generate.generate` (same prompts and options), yielding after each
    commit a dict from row (the prompt's index) to its newly emitted tokens (1-d): one token per step of greedy
    decoding, a verification's accepted drafts and the verifier's token for a speculative method. Joined per row,
    the chunks are generate's ``new_tokens`` of that row."""
    if "observer" in options:
        raise ValueError("observer is stream's own; use generate with an observer instead")
    commits: queue.Queue = queue.Queue()
    failure: list[BaseException] = []

    def decode() -> None:
        try:
            generate(model, input_ids, observer=_Handover(commits), **options)
        except BaseException as error:  # handed to the consuming thread
            failure.append(error)
        finally:
            commits.put(None)

    worker = threading.Thread(target=decode, name="looped_kv.stream", daemon=True)
    worker.start()
    while (commit := commits.get()) is not None:
        yield commit
    worker.join()
    if failure:
        raise failure[0]
