"""Preference losses (DPO, ORPO, SimPO) on one micro-batch of pairs: what the engines call instead of the causal LM
loss when ``task`` is a preference task, in the same loop, on every engine.

A micro-batch of ``m`` pairs is ``2m`` rows: the ``m`` chosen sequences, then the ``m`` rejected ones (prompt +
completion each, right-padded), with ``labels`` equal to the ids on the completion and -100 on the prompt and the
padding, so the prompt is never in a log-prob. One forward of the ``2m`` rows gives, per row, the summed log-prob
of its completion tokens and their count (:func:`sequence_logps`); the losses are functions of those numbers only:

- DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7): ``-log sigmoid(beta * ((pc - rc) - (pr - rr)))`` with
  ``p``/``r`` the policy's and the reference's summed log-probs of the chosen (c) and rejected (r) completions;
  ``ipo`` (Azar et al. 2023, arXiv:2310.12036, eq. 17) ``(d - 1 / (2 beta))**2`` on per-token averaged
  log-ratios (as TRL normalises it); ``hinge`` (SLiC, Zhao et al. 2023) ``relu(1 - beta * d)``.
- ORPO (Hong et al. 2024, arXiv:2403.07691, eqs. 4-7): the chosen completion's NLL (mean over its tokens) minus
  ``beta * log sigmoid(log odds(chosen) - log odds(rejected))``, with ``log odds(y) = a - log(1 - exp(a))`` of the
  per-token averaged log-prob ``a``; no reference.
- SimPO (Meng et al. 2024, arXiv:2405.14734, eq. 6): ``-log sigmoid(beta * (ac - ar) - gamma)`` on per-token
  averaged log-probs; no reference.

The DPO reference: with ``adapter_off`` the same forward runs first under ``torch.no_grad`` with peft's adapter
layers disabled (:func:`adapter_off`: the frozen base; no second model, no gradients, no saved activations); with
``precompute`` the batch carries ``ref_logps`` (computed once before training, :func:`reference_logps`).

Rewards, the margin and the preference accuracy of each training micro-batch are added to :class:`Stats`, which
the loop reads once per step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
MODEL_KEYS = ("input_ids", "attention_mask")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's tokens in the loss, their count), in fp32. Position t's logits predict the
    token at t + 1; positions whose label is -100 (prompt, padding) count nothing."""
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    keep = target != IGNORE_INDEX
    picked = torch.gather(logits, 2, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token = picked - torch.logsumexp(logits, dim=-1)
    return (token * keep).sum(-1), keep.sum(-1).to(torch.float32)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -ln 2 (Maechler 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def dpo_losses(pc, pr, rc, rr, beta: float, loss_type: str = "sigmoid", nc=None, nr=None) -> torch.Tensor:
    """Per-pair DPO losses from summed log-probs (policy chosen/rejected, reference chosen/rejected); ``nc``/``nr``:
    the completions' token counts (``ipo`` averages the log-ratios per token)."""
    dc, dr = pc - rc, pr - rr
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * (dc - dr))
    if loss_type == "hinge":
        return torch.relu(1 - beta * (dc - dr))
    if loss_type == "ipo":
        d = dc / nc.clamp(min=1) - dr / nr.clamp(min=1)
        return (d - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss_type {loss_type!r}")


def orpo_odds_term(ac, ar, beta: float) -> torch.Tensor:
    """Per-pair ``beta * log sigmoid(log odds ratio)`` of ORPO from per-token averaged log-probs (subtracted from
    the NLL)."""
    log_odds = (ac - ar) - (log1mexp(ac) - log1mexp(ar))
    return beta * F.logsigmoid(log_odds)


def simpo_losses(ac, ar, beta: float, gamma: float) -> torch.Tensor:
    """Per-pair SimPO losses from per-token averaged log-probs."""
    return -F.logsigmoid(beta * (ac - ar) - gamma)


@dataclass
class Stats:
    """Sums over the training micro-batches since the last :meth:`take` (tensors, read on the host once)."""

    sums: dict = field(default_factory=dict)

    def add(self, **values: torch.Tensor) -> None:
        for k, v in values.items():
            v = v.detach().float().sum()
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def take(self) -> dict[str, torch.Tensor]:
        out, self.sums = self.sums, {}
        return out


def _peft(model):
    """The peft model under an engine's wrapper (DeepSpeed's engine, DDP), or None."""
    m = getattr(model, "module", model)
    return m if hasattr(m, "disable_adapter") else None


@contextlib.contextmanager
def adapter_off(model):
    """A context in which ``model`` computes as its frozen base: every peft adapter layer's own "disabled" flag set,
    which is what peft's ``disable_adapter()`` sets for LoRA, without its switching the adapters' ``requires_grad``
    off and on again (FSDP2's sharded parameters do not survive that: the next backward's gradients come back in
    the wrong dtype). The layers then run their base layer alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    peft_model = _peft(model)
    if peft_model is None:
        raise ValueError("preference.reference=adapter_off needs a LoRA (peft) model")
    layers = [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was


def forward_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probs, token counts) of every row of ``batch`` through ``model``."""
    out = model(**{k: batch[k] for k in MODEL_KEYS if k in batch}, use_cache=False)
    return sequence_logps(out.logits, batch["labels"])


@torch.no_grad()
def reference_logps(model, batch: dict, adapter: bool) -> torch.Tensor:
    """The reference's summed log-probs of every row of ``batch`` (chosen rows, then rejected): ``model`` as it is
    (the starting weights, before any step), its adapter switched off when ``adapter``."""
    with adapter_off(model) if adapter else contextlib.nullcontext():
        return forward_logps(model, batch)[0]


@dataclass
class Objective:
    """A preference task's loss: ``task`` (dpo, orpo, simpo), ``beta``, DPO's ``loss_type``, SimPO's ``gamma``, and
    where DPO's reference comes from (``none``, ``adapter_off``, ``precompute``)."""

    task: str
    beta: float
    loss_type: str = "sigmoid"
    gamma: float = 0.5
    reference: str = "none"
    stats: Stats = field(default_factory=Stats, compare=False)

    def loss(self, model, batch: dict) -> torch.Tensor:
        """The mean loss over the micro-batch's pairs (``model``: what the engine calls)."""
        ref = None
        if self.task == "dpo" and self.reference == "adapter_off":
            ref = reference_logps(model, batch, adapter=True)  # first: its transient memory never meets the policy's
        elif self.task == "dpo":
            ref = batch["ref_logps"].to(torch.float32)
        logps, counts = forward_logps(model, batch)
        m = logps.shape[0] // 2
        pc, pr, nc, nr = logps[:m], logps[m:], counts[:m], counts[m:]
        ac, ar = pc / nc.clamp(min=1), pr / nr.clamp(min=1)
        if self.task == "dpo":
            rc, rr = ref[:m], ref[m:]
            losses = dpo_losses(pc, pr, rc, rr, self.beta, self.loss_type, nc, nr)
            chosen, rejected = self.beta * (pc - rc), self.beta * (pr - rr)
            loss = losses.mean()
        elif self.task == "orpo":
            nll = -pc.sum() / nc.sum().clamp(min=1)
            loss = nll - orpo_odds_term(ac, ar, self.beta).mean()
            chosen, rejected = self.beta * ac, self.beta * ar
        elif self.task == "simpo":
            loss = simpo_losses(ac, ar, self.beta, self.gamma).mean()
            chosen, rejected = self.beta * ac, self.beta * ar
        else:
            raise ValueError(f"unknown preference task {self.task!r}")
        if torch.is_grad_enabled():  # a training micro-batch (eval runs under no_grad)
            self.stats.add(pairs=torch.tensor(float(m)), rewards_chosen=chosen, rewards_rejected=rejected,
                           correct=(chosen > rejected).float())
        return loss


def step_metrics(sums: dict) -> dict[str, float]:
    """The metrics a step's :class:`Stats` sums (read on the host) give: mean rewards, margin and accuracy."""
    n = max(1.0, float(sums.get("pairs", 0.0)))
    c, r = float(sums.get("rewards_chosen", 0.0)) / n, float(sums.get("rewards_rejected", 0.0)) / n
    return {"rewards_chosen": c, "rewards_rejected": r, "reward_margin": c - r,
            "preference_accuracy": float(sums.get("correct", 0.0)) / n}


def objective_for(cfg) -> Objective | None:
    """The preference loss of a run's config (None for ``task=causal_lm``)."""
    from launcher.config.schema import preference_beta, reference_mode

    if cfg.task == "causal_lm":
        return None
    p = cfg.preference
    return Objective(task=cfg.task, beta=preference_beta(cfg), loss_type=p.loss_type, gamma=float(p.gamma),
                     reference=reference_mode(cfg))
