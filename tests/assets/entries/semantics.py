"""Tiny targets for the op- and error-semantics tables: each fails at step 0 in one loss or reduction op,
or raises in one op, for a reason only that op's meaning explains."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def _t(loss_fn, batches, model=None):
    torch.manual_seed(0)
    model = model or nn.Linear(4, 4)
    return {"model": model, "loss_fn": loss_fn, "batches": batches,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.01)}


def _x(n=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 4, generator=g) for _ in range(n)]


def kl_negative_target():
    """kl_div's target must be a distribution: a 'smoothed' target with a negative entry."""
    target = torch.tensor([0.6, 0.5, 0.1, -0.2])
    return _t(lambda m, x: F.kl_div(m(x).log_softmax(-1), target.expand(len(x), 4), reduction="batchmean"), _x())


def nll_zero_weight():
    """Every class present in the batch has weight 0: nll_loss divides 0 by a total weight of 0."""
    w = torch.tensor([0.0, 0.0, 1.0, 1.0])
    return _t(lambda m, x: F.nll_loss(m(x).log_softmax(-1), torch.tensor([0, 1] * 4), weight=w), _x())


def cholesky_not_pd():
    """A covariance of 2 samples in 4 dimensions is singular: cholesky raises."""
    def loss(m, x):
        h = m(x[:2])
        cov = h.T @ h / 2
        return torch.linalg.cholesky(cov).diagonal().log().sum()
    return _t(loss, _x())


def ctc_input_lengths_too_long():
    """input_lengths says 9 frames; the log-probs have 6."""
    def loss(m, x):
        logp = m(x).log_softmax(-1)[:6, None, :].expand(6, 2, 4)
        return F.ctc_loss(logp, torch.tensor([[1, 2], [2, 3]]), torch.tensor([9, 9]), torch.tensor([2, 2]))
    return _t(loss, _x())


def raises_plain_bug():
    """A shape bug: no NaN, no data problem, no known meaning - the user's error (exit 2)."""
    return _t(lambda m, x: (m(x) @ torch.ones(3)).sum(), _x())
