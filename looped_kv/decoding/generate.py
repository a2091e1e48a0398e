"""generate(): every decoder behind one call. Nothing in the decoding layer imports this module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import Tensor

from looped_kv.decoding.das_wave import WaveDrafts
from looped_kv.decoding.lookup import NgramDrafts
from looped_kv.decoding.loop import Drafter, Observer, decode
from looped_kv.decoding.prompts import check_prompts, eos_id, row_chunks
from looped_kv.decoding.result import Generation
from looped_kv.decoding.sampling import Sampler, row_seeds
from looped_kv.decoding.settings import DasWave, Decoding, MatureSpec, PromptLookup, SelfSpec, method_config
from looped_kv.decoding.speculative import LoopDrafts
from looped_kv.runtime.model import LoopedLM


def drafter(config: Decoding, num_loops: int) -> Drafter | None:
    """The drafter of ``config``'s method (None: greedy decoding)."""
    if isinstance(config, SelfSpec | MatureSpec):
        return LoopDrafts(draft_loops=config.draft_depth(num_loops), gamma=config.gamma, reads=config.reads(num_loops),
                          exact=config.exact, name=config.method)
    if isinstance(config, PromptLookup):
        return NgramDrafts(gamma=config.gamma, ngram=config.ngram, exact=config.exact)
    if isinstance(config, DasWave):
        return WaveDrafts(**config.schedule(num_loops), reads=config.reads(num_loops), exact=config.exact,
                          fuse_rounds=config.fuse_rounds)
    return None


def generate(model: LoopedLM, input_ids: Tensor | Sequence[Tensor], config: Decoding | None = None, *,
             observer: Observer | None = None, **options: object) -> Generation:
    """Generate with a looped model from one prompt or a batch, greedily or sampled; every method returns a
    :class:`Generation`.

    ``input_ids``: a (B, n) or (n,) integer tensor, or a list of prompts of different lengths. Rows are decoded
    together and each row emits exactly what it would emit alone.

    The options are those of ``method`` (default ``"ar"``), one dataclass each in
    :mod:`looped_kv.decoding.settings`, whose defaults are the only defaults (``config`` gives one whole, and
    ``options`` then change it):

    * ``"ar"`` (:class:`~looped_kv.decoding.settings.Greedy`): greedy full-depth autoregressive decoding (the
      baseline of every ratio), or with ``exit`` adaptive depth per token: each token stops at the first loop where
      its criterion fires (``"kl"``, ``"entropy"``, ``"latent"``, ``"argmax"``, ``"cosine"``, Ouro's ``"gate"``,
      ``"fixed"``; :mod:`looped_kv.decoding.exits`) against ``exit_threshold``, later tokens reading its planes past
      that loop per ``exited_reads`` (``"last"`` or ``"nearest-below"``); the result's ``row_loops`` and
      ``mean_loops`` say how many loops chose each token;
    * ``"self-spec"`` (:class:`~looped_kv.decoding.settings.SelfSpec`): sequential self-speculative decoding,
      ``draft_loops`` (d) loops per draft (default R // 8, at least 1: the papers' 4 at R = 32, 1 at Ouro's R = 4;
      :func:`~looped_kv.decoding.settings.default_draft_loops`), ``gamma`` (default 4) drafts per verification,
      drafts reading the prefix per ``prefix_reads`` (``"aligned"``, ``"deep-v"`` = Mature-V, ``"deep-k"``,
      ``"deep-kv"`` or a (kappa, nu) pair of planes); the default is ``"aligned"``, except with ``cache="ripe"``,
      where cached positions are read at plane R (``"deep-kv"``) as in RIPE Algorithm 1, line 3;
    * ``"mature-spec"`` (:class:`~looped_kv.decoding.settings.MatureSpec`): self-spec with deep K/V prefix reads
      (DAS Section 4.1), with the same ``draft_loops`` and ``gamma``;
    * ``"pld"`` (:class:`~looped_kv.decoding.settings.PromptLookup`): prompt lookup decoding, ``ngram``-gram
      drafts verified at full depth;
    * ``"das-wave"`` (:class:`~looped_kv.decoding.settings.DasWave`): carried parallel refinement (DAS Section
      3.3) with ``max_width`` (the verifier capacity gamma, default 32), ``rounds`` (J), ``initial_width``
      (W_init), ``updates`` (k), ``carry`` and ``prefix_reads`` (default ``"deep-kv"``); the defaults are the
      paper's Huginn configuration at R = 32, with J following R (3R // 4: J k stays 1.5 R loops of refinement).

    Every method takes :class:`~looped_kv.decoding.settings.Decoding`'s options: ``cache`` names the verifier's
    cache policy (:func:`looped_kv.runtime.policy.make_policy`): ``"full"``, ``"deepest"``, ``"ripe"`` with
    ``window``, ``"k-deepest"``/``"share"``/``"first"`` with ``k``, ``"sinks"``. Speculative methods require a
    block-independent cache (full, or RIPE with window >= gamma, or DAS-Wave's max_width; RIPE Proposition 1)
    unless ``exact=False``. ``num_loops`` defaults to the model's mean recurrence. A row stops after
    ``max_new_tokens`` (an int, or one per prompt) or after emitting the end-of-text token (``eos_token_id``,
    default the tokenizer's) unless ``stop_at_eos=False``. ``compile=True`` runs every method's passes on
    torch.compile'd steps with static shapes and its prefill on one trace for every prompt length
    (:mod:`looped_kv.decoding.compiled`). ``rows_per_chunk`` decodes a large batch in row chunks of at most that many
    rows (one chunk's cache in memory at a time); the rows emit the same tokens either way. An option the method
    does not take is refused; ``observer`` (:class:`~looped_kv.decoding.loop.Observer`) sees every verification and
    every model pass.

    Every method samples with ``temperature`` > 0 (default 0: greedy decoding), ``top_k``, ``top_p`` and ``min_p``,
    with randomness from ``seed`` (an int s: row i draws with seed s + i; or one per prompt): a row emits the same
    tokens in any batch, chunk or compiled run as alone with its seed. Speculative methods sample exactly from the
    verifier's distribution (speculative sampling, Leviathan et al. 2023; Chen et al. 2023), n-gram drafts as point
    masses and DAS-Wave's drafts from its wave's last readout (:mod:`looped_kv.decoding.sampling`).
    """
    if config is None:
        config = method_config(options.pop("method", None) or "ar", **options)
    elif options:
        method = options.pop("method", config.method)
        if method != config.method:
            raise ValueError(f"method={method!r} contradicts config, a {type(config).__name__} ({config.method!r})")
        config = method_config(config.method, **{**vars(config), **options})
    policy = config.check(model.config.block_size, model.config.mean_recurrence)
    exits = config.exit_rule(model.config, policy)
    draft = drafter(config, policy.num_loops)
    prompts, budgets = check_prompts(model, input_ids, config.max_new_tokens, 0 if draft is None else draft.lookahead)
    seeds = [] if config.temperature == 0 else row_seeds(config.seed, len(prompts))
    chunks = row_chunks(len(prompts), config.rows_per_chunk)
    if len(chunks) > 1:
        return Generation.concat([generate(model, prompts[rows], replace(config, max_new_tokens=budgets[rows],
                                                                         seed=seeds[rows] or None,
                                                                         rows_per_chunk=None), observer=observer)
                                  for rows in chunks])
    eos = eos_id(model, config.eos_token_id, config.stop_at_eos)
    sampler = Sampler(config.temperature, config.top_k, config.top_p, config.min_p, seeds)
    return decode(model, prompts, budgets, policy=policy, drafter=draft, eos=eos, compile=config.compile,
                  progress=config.progress, observer=observer, sampler=sampler, exits=exits)

