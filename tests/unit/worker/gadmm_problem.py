"""The convex test problem of GADMM: L2-regularised logistic regression, split non-iid.

The centralised optimum comes from scikit-learn's solver (``C = 1 / (l2 * M)`` turns its
``sum loss + ||w||²/2`` into our ``mean loss + l2/2 ||w||²``), independent of the code tested.
"""

from __future__ import annotations

import torch
from sklearn.linear_model import LogisticRegression

from services.worker.sync.gadmm import logistic_objective, planted_logistic

ROWS, DIM, L2 = 800, 6, 1e-2


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    return planted_logistic(ROWS, DIM)


def centralised_loss(x: torch.Tensor, y: torch.Tensor) -> float:
    clf = LogisticRegression(C=1 / (L2 * len(y)), fit_intercept=False, tol=1e-12,
                             max_iter=1000).fit(x.numpy(), y.numpy())
    return float(logistic_objective(torch.tensor(clf.coef_[0]), x, y, total=len(y), l2=L2))


def loss(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(logistic_objective(theta.detach().double(), x, y, total=len(y), l2=L2))
