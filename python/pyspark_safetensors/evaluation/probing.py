"""SAEBench's sparse probing (``sae_bench/evals/sparse_probing``, SAEBench 0.6.0), defined
as there, for any labelled examples:

- each example is the mean of its tokens' activations (``mean_pool``; a dataset of single
  rows, as the synthetic ones, is one example per row), the SAE's latents pooled the same
  way (its dense code, 0 where a latent is silent, then the mean);
- a binary task is balanced as SAEBench balances one class against the rest
  (``prepare_probe_data``): every positive of the split, and as many negatives drawn at
  random (``balanced_task``), on the training and on the test split alike;
- ``top_k_latents``: the k latents with the largest ``|mean(positives) - mean(negatives)|``
  on the training split (``get_top_k_mean_diff_mask``);
- a logistic regression on those k columns (k = 1, 2, 5), L2-penalised as scikit-learn's
  ``LogisticRegression(C=1.0)`` fits it (``train_sklearn_probe``: the objective
  ``C * sum(log loss) + |w|^2 / 2``, the intercept unpenalised), its accuracy on the test
  split (a class-1 prediction where ``x w + b > 0``);
- the same on the full width, and both on the raw activations (the baseline).

Where we differ: scikit-learn is not a dependency here, so the regression is minimised by
``torch.optim.LBFGS`` in float64 (the same objective; ``tests/evaluation/test_probing.py``
checks it against a Newton solve); SAEBench's full-width probes (SAE latents and raw
activations) are trained by AdamW for up to 100 epochs with the best epoch chosen on the
*test* accuracy, ours are the same L2 regression as the top-k ones, fitted on the training
split alone (no model selection on the test split); ties of the class-mean difference go
to the lower index (torch's stable sort), SAEBench leaves them to an unstable one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..format.errors import InvalidArgumentError

#: The k of SAEBench's sparse probes (its ``k_values``).
PROBE_KS = (1, 2, 5)
#: scikit-learn's default inverse L2 strength, which SAEBench keeps.
PROBE_C = 1.0
#: SAEBench's ``max_iter`` (scikit-learn's default is 100).
MAX_ITER = 1000


@dataclass(frozen=True)
class ProbeTask:
    """One balanced binary task over a pool of examples: indices into the pool and 0/1
    labels of its training and test splits."""

    name: str
    train_index: np.ndarray
    train_labels: np.ndarray
    test_index: np.ndarray
    test_labels: np.ndarray


def mean_pool(acts_TD: torch.Tensor, example_of_T: torch.Tensor, n_examples: int) -> torch.Tensor:
    """``[n_examples, D]``: the mean of each example's rows (``example_of_T[t]``: the example
    of row t, in ``[0, n_examples)``); an example without rows is 0."""
    sums = torch.zeros(n_examples, acts_TD.shape[1], dtype=torch.float64)
    sums.index_add_(0, example_of_T.long(), acts_TD.double())
    counts = torch.bincount(example_of_T.long(), minlength=n_examples).clamp(min=1)
    return (sums / counts.unsqueeze(1)).float()


def balanced_task(name: str, fires: np.ndarray, train: np.ndarray, test: np.ndarray,
                  seed: int) -> ProbeTask:  # fmt: skip
    """The task "does it fire" over a pool whose example i has label ``fires[i]``, split
    into the pool indices ``train`` and ``test``: every positive of a split and as many of
    its negatives drawn at random (seeded by ``seed``), shuffled (SAEBench's
    ``prepare_probe_data`` with one negative class)."""
    rng = np.random.default_rng(seed)
    parts = []
    for split in (np.asarray(train), np.asarray(test)):
        pos, neg = split[fires[split]], split[~fires[split]]
        n = min(len(pos), len(neg))
        if n == 0:
            raise InvalidArgumentError(
                f"probe task {name}: a split has no positive or no negative example"
            )
        pos = rng.permutation(pos)[:n]
        index = np.concatenate([pos, rng.permutation(neg)[:n]])
        labels = np.concatenate([np.ones(n, np.int64), np.zeros(n, np.int64)])
        order = rng.permutation(2 * n)
        parts += [index[order], labels[order]]
    return ProbeTask(name, *parts)


def top_k_latents(acts_BD: torch.Tensor, labels_B: torch.Tensor, k: int) -> torch.Tensor:
    """The k columns with the largest absolute difference of the class means (ties: the
    lower index)."""
    pos, neg = acts_BD[labels_B == 1].double(), acts_BD[labels_B == 0].double()
    diff = (pos.mean(0) - neg.mean(0)).abs()
    return torch.sort(diff, descending=True, stable=True).indices[:k]


def fit_logistic(x_BD: torch.Tensor, labels_B: torch.Tensor, *, c: float = PROBE_C,
                 max_iter: int = MAX_ITER) -> tuple[torch.Tensor, float]:  # fmt: skip
    """``(w [D], b)`` minimising ``c * sum_i log(1 + exp(-s_i (x_i w + b))) + |w|^2 / 2``
    (``s_i = +-1``; scikit-learn's L2 logistic regression), by L-BFGS in float64."""
    x = x_BD.double()
    s = labels_B.double() * 2 - 1
    n = x.shape[0]
    params = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    # the objective over c n: the same minimiser, gradients of order 1 for the tolerances
    scale = 1.0 / (c * n)
    optimizer = torch.optim.LBFGS([params], lr=1, max_iter=max_iter, history_size=20,
                                  tolerance_grad=1e-10, tolerance_change=1e-14,
                                  line_search_fn="strong_wolfe")  # fmt: skip

    def closure():
        optimizer.zero_grad()
        w, b = params[:-1], params[-1]
        loss = torch.nn.functional.softplus(-s * (x @ w + b)).mean() + scale * 0.5 * w.dot(w)
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    out = params.detach()
    return out[:-1], float(out[-1])


def probe_accuracy(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor,
                   test_y: torch.Tensor, *, c: float = PROBE_C) -> float:  # fmt: skip
    """Test accuracy of the logistic regression fitted on the training split."""
    w, b = fit_logistic(train_x, train_y, c=c)
    predicted = (test_x.double() @ w + b > 0).long()
    return float((predicted == test_y.long()).double().mean())


def sparse_probing(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor,
                   test_y: torch.Tensor, *, ks: Sequence[int] = PROBE_KS, full: bool = True,
                   c: float = PROBE_C) -> dict[str, float]:  # fmt: skip
    """``{"top_{k}": accuracy, ..., "full": accuracy}`` of one task: probes on the top-k
    columns chosen on the training split, and on all of them."""
    out = {}
    for k in ks:
        if k > train_x.shape[1]:
            raise InvalidArgumentError(f"probe k={k} exceeds the width {train_x.shape[1]}")
        cols = top_k_latents(train_x, train_y, k)
        out[f"top_{k}"] = probe_accuracy(train_x[:, cols], train_y, test_x[:, cols], test_y, c=c)
    if full:
        out["full"] = probe_accuracy(train_x, train_y, test_x, test_y, c=c)
    return out


def probe_tasks(pool_acts: torch.Tensor, tasks: Sequence[ProbeTask], *,
                ks: Sequence[int] = PROBE_KS, full: bool = True) -> dict:  # fmt: skip
    """Every task on the pooled examples ``pool_acts [E, D]`` (SAE latents or raw
    activations): ``{"tasks": {name: {top_k: acc, full: acc}}, "top_k": mean over the
    tasks, ..., "full": mean}``, SAEBench's averages."""
    per_task = {}
    for t in tasks:
        train_y, test_y = torch.from_numpy(t.train_labels), torch.from_numpy(t.test_labels)
        per_task[t.name] = sparse_probing(
            pool_acts[torch.from_numpy(t.train_index)], train_y,
            pool_acts[torch.from_numpy(t.test_index)], test_y, ks=ks, full=full,
        )  # fmt: skip
    keys = [f"top_{k}" for k in ks] + (["full"] if full else [])
    means = {key: float(np.mean([r[key] for r in per_task.values()])) for key in keys}
    return {**means, "tasks": per_task}


@torch.no_grad()
def dense_codes(sae, x: torch.Tensor, batch: int = 4096) -> torch.Tensor:
    """``[B, latents]``: the SAE's code of every row (0 where a latent is silent), in eval
    mode (a BatchTopK SAE by its threshold)."""
    was_training = sae.training
    sae.eval()
    try:
        parts = [sae.encode_dense(x[i : i + batch].float()).float().cpu()
                 for i in range(0, len(x), batch)]  # fmt: skip
    finally:
        sae.train(was_training)
    return torch.cat(parts) if parts else torch.zeros(0, sae.latents_total)


def synthetic_probe_tasks(active_PF: np.ndarray, *, train_rows: int, n_tasks: int = 8,
                          min_positives: int = 20, seed: int = 0,
                          features: Sequence[int] = ()) -> list[ProbeTask]:  # fmt: skip
    """Tasks "does true feature f fire" over a pool of synthetic rows (``active_PF [P, F]``
    bool: which features fire in each row): rows ``[0, train_rows)`` the training split,
    the rest the test split. The features are ``features`` when given, else ``n_tasks``
    spread evenly over the ranks of firing frequency among those with at least
    ``min_positives`` positives and negatives in each split."""
    active = np.asarray(active_PF, dtype=bool)
    if not 0 < train_rows < len(active):
        raise InvalidArgumentError(
            f"probe train_rows={train_rows} must leave test rows in a pool of {len(active)}"
        )
    train, test = np.arange(train_rows), np.arange(train_rows, len(active))

    def counts(split):
        pos = active[split].sum(0)
        return np.minimum(pos, len(split) - pos)

    eligible = np.flatnonzero((counts(train) >= min_positives) & (counts(test) >= min_positives))
    if features:
        chosen = [int(f) for f in features]
        bad = sorted(set(chosen) - set(eligible.tolist()))
        if bad:
            raise InvalidArgumentError(
                f"probe features {bad} fire fewer than {min_positives} times (or not fewer "
                "than that many rows from the end) in a probe split; choose others or lower "
                "probe_min_positives"
            )
    else:
        if len(eligible) == 0:
            raise InvalidArgumentError(
                f"no true feature has {min_positives} positives in both probe splits; "
                "raise the probe rows or lower probe_min_positives"
            )
        order = eligible[np.argsort(-active[train][:, eligible].sum(0), kind="stable")]
        picks = np.unique(np.linspace(0, len(order) - 1, min(n_tasks, len(order))).round())
        chosen = [int(order[int(i)]) for i in picks]
    return [balanced_task(f"feature_{f}", active[:, f], train, test, seed + f) for f in chosen]


def factor_probe_tasks(labels: Mapping[str, Sequence], *, train_examples: int,
                       min_positives: int = 5,
                       seed: int = 0) -> tuple[list[ProbeTask], list[str]]:  # fmt: skip
    """SAEBench's tasks over categorical labels (``labels``: ``{factor: a value per
    example}``, e.g. the toy ViT's ``colour`` of each image): for each factor and each of
    its values, "is the factor this value", one class against the rest (balanced as
    ``balanced_task``); examples ``[0, train_examples)`` the training split, the rest the
    test split. Returns the tasks, named ``factor=value``, and the names of those left out
    because a split holds fewer than ``min_positives`` positives or negatives."""
    n = len(next(iter(labels.values()), ()))
    if not 0 < train_examples < n:
        raise InvalidArgumentError(
            f"probe train_examples={train_examples} must leave test examples of {n}"
        )
    train, test = np.arange(train_examples), np.arange(train_examples, n)
    tasks, skipped = [], []
    for factor, column in labels.items():
        column = np.asarray(column, dtype=object)
        if len(column) != n:
            raise InvalidArgumentError(f"factor {factor!r}: {len(column)} labels, not {n}")
        for value in sorted({v for v in column if v is not None}, key=str):
            fires = column == value
            name = f"{factor}={value}"
            least = min(min(fires[s].sum(), (~fires[s]).sum()) for s in (train, test))
            if least < min_positives:
                skipped.append(name)
                continue
            tasks.append(balanced_task(name, fires, train, test, seed + len(tasks)))
    return tasks, skipped
