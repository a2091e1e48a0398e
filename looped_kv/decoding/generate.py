"""generate(): every decoder behind one call. Nothing in the decoding layer imports this module."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from looped_kv.decoding import settings
from looped_kv.decoding.core import Generation, check_prompts, eos_id, row_passes
from looped_kv.decoding.das_wave import das_wave
from looped_kv.decoding.greedy import greedy
from looped_kv.decoding.lookup import prompt_lookup
from looped_kv.decoding.speculative import self_speculative
from looped_kv.runtime.model import LoopedLM
from looped_kv.runtime.policy import make_policy, make_prefix_reads


def generate(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], *, max_new_tokens: int | Sequence[int] = 32,
             method: str = "ar", cache: str = "full", num_loops: int | None = None, window: int | None = None,
             k: int | None = None, sinks: int | None = None, draft_loops: int = settings.DRAFT_LOOPS,
             block: int | None = None, prefix_reads: str | tuple[int, int] | None = None, exact: bool = True,
             ngram: int = settings.NGRAM, rounds: int = settings.WAVE["rounds"],
             initial_width: int = settings.WAVE["initial_width"], updates: int = settings.WAVE["updates"],
             carry: bool = settings.WAVE["carry"], stop_at_eos: bool = True, eos_token_id: int | None = None,
             compile: bool = False, rows_per_pass: int | None = None, progress: bool = False) -> Generation:
    """Generate greedily with a looped model from one prompt or a batch; every method returns a :class:`Generation`.

    ``input_ids``: a (B, n) or (n,) tensor, or a list of prompts of different lengths. Rows are decoded
    together and each row emits exactly what it would emit alone.

    ``method`` (:data:`looped_kv.decoding.settings.METHODS`):

    * ``"ar"``: greedy full-depth autoregressive decoding (the baseline of every ratio);
    * ``"self-spec"``: sequential self-speculative decoding, ``draft_loops`` (d) loops per draft,
      ``block`` (gamma, default 4) drafts per verification, drafts reading the prefix per
      ``prefix_reads`` (``"aligned"``, ``"deep-v"`` = Mature-V, ``"deep-k"``, ``"deep-kv"`` or a
      (kappa, nu) pair of planes); the default is ``"aligned"``, except with ``cache="ripe"``, where
      cached positions are read at plane R (``"deep-kv"``) as in RIPE Algorithm 1, line 3;
    * ``"mature-spec"``: self-spec with deep K/V prefix reads (DAS Section 4.1);
    * ``"pld"``: prompt lookup decoding, ``ngram``-gram drafts verified at full depth;
    * ``"das-wave"``: carried parallel refinement (DAS Section 3.3) with ``block`` (gamma, default
      32), ``rounds`` (J), ``initial_width`` (W_init), ``updates`` (k), ``carry`` and
      ``prefix_reads`` (default ``"deep-kv"``); the defaults are the paper's Huginn configuration.

    ``cache`` names the verifier's cache policy (:func:`looped_kv.runtime.policy.make_policy`): ``"full"``,
    ``"deepest"``, ``"ripe"`` with ``window``, ``"k-deepest"``/``"share"``/``"first"`` with ``k``,
    ``"sinks"``. Speculative methods require a block-independent cache (full, or RIPE with
    window >= block; RIPE Proposition 1) unless ``exact=False``. ``num_loops`` defaults to the
    model's mean recurrence.

    A row stops after ``max_new_tokens`` (an int, or one per prompt) or after emitting the end-of-text
    token (``eos_token_id``, default the tokenizer's) unless ``stop_at_eos=False``. ``compile=True``
    (method ``"ar"``) runs a torch.compile'd decode step with static shapes. ``rows_per_pass`` decodes a large
    batch in passes of at most that many rows (one pass's cache in memory at a time); the rows emit the same
    tokens either way.
    """
    settings.check_method(method)
    if rows_per_pass is not None:
        rows, budgets = check_prompts(model, input_ids, max_new_tokens)
        passes = row_passes(len(rows), rows_per_pass)
        if len(passes) > 1:
            options = {name: value for name, value in locals().items()
                       if name not in ("model", "input_ids", "max_new_tokens", "rows_per_pass", "rows", "budgets",
                                       "passes")}
            return Generation.concat([generate(model, rows[rows_in], max_new_tokens=budgets[rows_in], **options)
                                      for rows_in in passes])
    if compile and method != "ar":
        raise ValueError(f"compile=True is for method='ar' (greedy decoding), got method={method!r}")
    R = model.config.mean_recurrence if num_loops is None else num_loops
    policy = make_policy(cache, R, window=window, k=k, sinks=sinks)
    eos = eos_id(model, eos_token_id, stop_at_eos)
    if method == "ar":
        return greedy(model, input_ids, max_new_tokens, policy=policy, eos=eos, compile=compile, progress=progress)
    if method == "pld":
        return prompt_lookup(model, input_ids, max_new_tokens, policy=policy,
                             block=settings.BLOCK if block is None else block, ngram=ngram, exact=exact, eos=eos,
                             progress=progress)
    deep = method in ("mature-spec", "das-wave") or cache == "ripe"  # RIPE Algorithm 1: drafts read plane R
    reads = make_prefix_reads(prefix_reads or ("deep-kv" if deep else "aligned"), R)
    if method == "das-wave":
        return das_wave(model, input_ids, max_new_tokens, policy=policy,
                        block=settings.WAVE["block"] if block is None else block, rounds=rounds,
                        initial_width=initial_width, updates=updates, carry=carry, reads=reads, exact=exact, eos=eos,
                        progress=progress)
    if method == "mature-spec" and reads != make_prefix_reads("deep-kv", R):
        raise ValueError("method='mature-spec' reads the prefix at deep K/V; use method='self-spec' with "
                         "prefix_reads for other read policies")
    return self_speculative(model, input_ids, max_new_tokens, policy=policy, draft_loops=draft_loops,
                            block=settings.BLOCK if block is None else block, reads=reads, exact=exact, eos=eos,
                            progress=progress)
