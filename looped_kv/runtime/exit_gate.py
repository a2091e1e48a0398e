"""Ouro's exit gate: each loop's exit probability, and the two readouts the reference forms from it.

After loop u = 0..S-1 (S loops, 0-based as in the reference) the gate reads the loop's normed output
s(u+1): one logit g_u per token, lambda_u = sigmoid(g_u). The exit distribution over loops is

    p_u = lambda_u (1 - lambda_0) ... (1 - lambda_{u-1})      for u < S - 1,
    p_{S-1} = (1 - lambda_0) ... (1 - lambda_{S-2})            (the remaining mass; lambda_{S-1} is not used),

computed in the model's dtype, as ``OuroForCausalLM.forward`` does. Its readouts, per token:

* the threshold readout: the logits of the first loop whose cumulative exit probability reaches the
  threshold, or of the last loop if none does (a plain forward and ``generate`` of the HF code, whose
  checkpoints set ``early_exit_threshold`` 1.0);
* the expected logits: sum_u p_u z_u (the HF code's ``use_weighted_exit``, and its training loss).

The hazard of the threshold 1.0: in exact arithmetic, and in every float64 run of the fixtures, the
cumulative probability first reaches 1 at the last loop, so the readout is the last loop's logits, which
is what :meth:`LoopedLM.forward` returns. In float32 and bfloat16 the cumulative sum can round up to 1.0
at an earlier loop (or a sigmoid can round to exactly 1), and the HF code then reads that token out from the
earlier loop: :func:`threshold_logits` at ``config.exit_threshold`` reproduces that choice, rounding included.
The runtime's forward and every decoder always read the last loop they run.

A model of another family has no gate: :func:`check_gate` says so in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor

from looped_kv.runtime.attention import CausalRouter
from looped_kv.runtime.model import LoopedLM


def has_exit_gate(model: LoopedLM) -> bool:
    return model.config.exit_gate


def check_gate(model: LoopedLM) -> None:
    """ValueError, in one line, unless ``model`` has an exit gate."""
    if not has_exit_gate(model):
        name = getattr(model, "source", "this model")
        raise ValueError(f"model {name} (family {model.config.family!r}) has no exit gate: only Ouro checkpoints "
                         f"(family 'ouro') carry one, so it has no exit distribution")


@dataclass(frozen=True)
class LoopOutputs:
    """Every loop's output of one cache-free forward of an Ouro model."""

    states: Tensor  # (B, n, S, n_embd): the normed state after each loop, what the gate and the head read
    gate_logits: Tensor  # (B, n, S): the exit gate's raw output per loop (before the sigmoid)

    @property
    def pdf(self) -> Tensor:
        """(B, n, S): the exit distribution (:func:`exit_pdf`)."""
        return exit_pdf(self.gate_logits)

    def logits(self, model: LoopedLM) -> Tensor:
        """(B, n, S, V): each loop's logits, the head applied to that loop's state in the model's dtype."""
        return model.lm_head(self.states)


@torch.no_grad()
def loop_outputs(model: LoopedLM, input_ids: Tensor, num_loops: int | None = None, *,
                 positions: Tensor | None = None) -> LoopOutputs:
    """Each loop's state and gate logit for ``input_ids`` (B, n), ``num_loops`` loops (default the config's S)."""
    check_gate(model)
    num_loops = model.config.mean_recurrence if num_loops is None else num_loops
    if num_loops < 1:
        raise ValueError(f"num_loops must be >= 1, got {num_loops}")
    positions = torch.arange(input_ids.shape[1], device=model.device) if positions is None else positions
    router = CausalRouter()
    embedded = model.embed(input_ids, positions, router)
    state, states = model.initial_state(positions, input_ids.shape[0], tokens=input_ids), []
    core = model.core_weights()
    for r in range(1, num_loops + 1):
        state = model.loop(state, embedded, positions, router, r, core)
        states.append(state)
    stacked = torch.stack(states, dim=2)
    return LoopOutputs(stacked, model.transformer.exit_gate(stacked).squeeze(-1))


def exit_pdf(gate_logits: Tensor) -> Tensor:
    """The exit distribution (..., S) from the gate logits (..., S), in their dtype (the module's equation)."""
    lam = torch.sigmoid(gate_logits)
    remaining = torch.ones_like(lam[..., 0])
    pdf = []
    for u in range(lam.shape[-1]):
        if u < lam.shape[-1] - 1:
            pdf.append(lam[..., u] * remaining)
            remaining = remaining * (1.0 - lam[..., u])
        else:
            pdf.append(remaining)
    return torch.stack(pdf, dim=-1)


def threshold_exit(pdf: Tensor, threshold: float) -> Tensor:
    """(...,) the 0-based loop at which each token exits: the first whose cumulative probability (in the pdf's dtype)
    reaches ``threshold``, else the last."""
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    reached = pdf.cumsum(-1) >= threshold
    first = reached.float().argmax(-1)
    return torch.where(reached.any(-1), first, pdf.shape[-1] - 1)


def threshold_logits(loop_logits: Tensor, pdf: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """The threshold readout: (B, n, V) logits of each token's exit loop, and those loops (B, n) (0-based).

    ``loop_logits`` (B, n, S, V) and ``pdf`` (B, n, S). At Ouro's threshold 1.0 a float32 or bfloat16 pdf can
    make a token exit before the last loop (the module's hazard).
    """
    steps = threshold_exit(pdf, threshold)
    index = steps[..., None, None].expand(*steps.shape, 1, loop_logits.shape[-1])
    return loop_logits.gather(-2, index).squeeze(-2), steps


def expected_logits(loop_logits: Tensor, pdf: Tensor) -> Tensor:
    """The expected-logits readout sum_u p_u z_u (B, n, V), summed loop by loop in the logits' dtype as the
    reference does."""
    total = None
    for u in range(loop_logits.shape[-2]):
        term = loop_logits[..., u, :] * pdf[..., u, None].to(loop_logits.dtype)
        total = term if total is None else total + term
    return total


def exit_distribution(model: LoopedLM, input_ids: Tensor | list[Tensor], num_loops: int | None = None) -> Tensor:
    """Every token's exit distribution, (tokens, S) in float64: the rows of ``input_ids`` ((B, n), or a list of
    (1, n_i) prompts of any lengths) one after another. ValueError for a model without a gate."""
    check_gate(model)
    rows = [input_ids] if isinstance(input_ids, Tensor) else input_ids
    return torch.cat([loop_outputs(model, ids, num_loops).pdf.reshape(-1, num_loops or model.config.mean_recurrence)
                      for ids in rows]).double().cpu()


def threshold_steps(model: LoopedLM, input_ids: Tensor | list[Tensor], threshold: float | None = None,
                    num_loops: int | None = None) -> Tensor:
    """Every token's exit loop (0-based) under the threshold readout, (tokens,) int64 on the CPU, the exit
    distribution and its cumulative sum in the model's dtype as the reference forms them; ``threshold`` defaults to
    the config's ``early_exit_threshold``. At Ouro's 1.0 a token exits before the last loop only by rounding (the
    module's hazard). Rows as :func:`exit_distribution`'s."""
    check_gate(model)
    threshold = model.config.exit_threshold if threshold is None else threshold
    if threshold is None:
        raise ValueError("threshold must be given: this checkpoint's early_exit_threshold is null")
    rows = [input_ids] if isinstance(input_ids, Tensor) else input_ids
    return torch.cat([threshold_exit(loop_outputs(model, ids, num_loops).pdf, threshold).reshape(-1)
                      for ids in rows]).cpu()


def exit_summary(pdf: Tensor, thresholds: tuple[float, ...] = (0.5, 0.9)) -> pd.DataFrame:
    """One row per loop u (1-based, as planes are numbered): the mean exit probability over tokens, and for each
    threshold the share of tokens the threshold readout reads out at that loop (``pdf``: (tokens, S))."""
    loops = pdf.shape[-1]
    table = {"mean exit probability": pdf.mean(0).tolist()}
    for threshold in thresholds:
        steps = threshold_exit(pdf, threshold)
        table[f"exits at threshold {threshold:g}"] = (torch.bincount(steps, minlength=loops) / len(steps)).tolist()
    return pd.DataFrame(table, index=pd.RangeIndex(1, loops + 1, name="loop"))
