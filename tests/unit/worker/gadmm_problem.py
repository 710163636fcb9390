"""A convex test problem for GADMM: L2-regularised logistic regression, split non-iid.

The centralised optimum comes from scikit-learn's solver (``C = 1 / (l2 * M)`` turns its
``sum loss + ||w||²/2`` into our ``mean loss + l2/2 ||w||²``), independent of the code tested.
"""

from __future__ import annotations

import torch
from sklearn.linear_model import LogisticRegression

from services.worker.sync.gadmm import logistic_objective

ROWS, DIM, L2 = 800, 6, 1e-2


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by their first feature, so each worker's slice has its own optimum."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, DIM, generator=g, dtype=torch.float64)
    x[:, -1] = 1.0                                                   # the intercept
    w = torch.randn(DIM, generator=g, dtype=torch.float64)
    y = (torch.rand(ROWS, generator=g, dtype=torch.float64) < torch.sigmoid(x @ w)).double()
    order = torch.argsort(x[:, 0])
    return x[order], y[order]


def centralised_loss(x: torch.Tensor, y: torch.Tensor) -> float:
    clf = LogisticRegression(C=1 / (L2 * len(y)), fit_intercept=False, tol=1e-12,
                             max_iter=1000).fit(x.numpy(), y.numpy())
    return float(logistic_objective(torch.tensor(clf.coef_[0]), x, y, total=len(y), l2=L2))


def loss(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(logistic_objective(theta.detach().double(), x, y, total=len(y), l2=L2))
