"""Evaluation metrics as the field reports them, per policy and for the population of policies.

Inputs are per-prompt sample tables: ``correct`` bool[N, K] (sample k of prompt n verified) and, for
majority voting, ``answers`` (N lists of K answer keys, None where no answer was found).

* avg@K -- mean correctness over all N*K samples (the mean pass@1 over K samples).
* pass@k -- Chen et al. (2021)'s unbiased estimator ``1 - C(n - c, k) / C(n, k)`` per prompt (n samples, c
  correct), averaged over prompts; k = 1, 2, 4, ..., K (K included).
* maj@K -- the most frequent answer key among a prompt's samples is its vote; ties go to the key whose first
  occurrence comes first (lowest sample index); a prompt with no answer at all counts as wrong. The vote is
  right when the sample that first gave that key is correct.
* population pass@k -- a prompt counts as solved when any policy solves it with k samples each:
  ``1 - prod_i (1 - pass@k_i)`` per prompt (independent samples per policy), averaged over prompts.
* transfer[i][j] -- the fraction of prompts policy j solves (at least one correct sample) that policy i does not:
  what sharing could transfer from j to i.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["avg_at_k", "k_values", "maj_at_k", "pass_at_k", "pass_at_k_per_prompt", "population_metrics",
           "sample_metrics", "transfer_matrix"]


def k_values(K: int) -> list[int]:
    """1, 2, 4, ... up to K, and K itself."""
    ks, k = [], 1
    while k < K:
        ks.append(k)
        k *= 2
    return ks + [K] if K >= 1 else []


def pass_at_k_per_prompt(n: int, c: np.ndarray, k: int) -> np.ndarray:
    """f64[N]: unbiased pass@k of each prompt from ``n`` samples with ``c`` int[N] correct (stable product form)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    c = np.asarray(c, np.int64)
    out = np.ones(c.shape, np.float64)
    for i, ci in np.ndenumerate(c):
        if n - ci >= k:
            out[i] = 1.0 - np.prod(1.0 - k / np.arange(n - ci + 1, n + 1, dtype=np.float64))
    return out


def pass_at_k(correct: np.ndarray, k: int) -> float:
    """Mean unbiased pass@k over prompts of ``correct`` bool[N, K]."""
    correct = np.asarray(correct, bool)
    return float(pass_at_k_per_prompt(correct.shape[1], correct.sum(1), k).mean()) if correct.size else 0.0


def avg_at_k(correct: np.ndarray) -> float:
    """Mean correctness over every sample of ``correct`` bool[N, K]."""
    correct = np.asarray(correct, bool)
    return float(correct.mean()) if correct.size else 0.0


def _vote(keys: Sequence) -> int | None:
    """Index of the sample whose key wins the vote (ties: earliest first occurrence); None without keys."""
    counts: dict = {}
    first: dict = {}
    for k, key in enumerate(keys):
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, k)
    if not counts:
        return None
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[best]


def maj_at_k(correct: np.ndarray, answers: Sequence[Sequence]) -> float:
    """Fraction of prompts whose majority answer is correct (see the module docstring for ties)."""
    correct = np.asarray(correct, bool)
    hits = []
    for row, keys in zip(correct, answers):
        idx = _vote(keys)
        hits.append(idx is not None and bool(row[idx]))
    return float(np.mean(hits)) if hits else 0.0


def sample_metrics(correct: np.ndarray, answers: Sequence[Sequence] | None = None) -> dict:
    """``{"avg@K", "pass@k" for each k, "maj@K"}`` of one policy's table ``correct`` bool[N, K]."""
    correct = np.asarray(correct, bool)
    K = correct.shape[1]
    out = {f"avg@{K}": avg_at_k(correct)}
    out.update({f"pass@{k}": pass_at_k(correct, k) for k in k_values(K)})
    if answers is not None:
        out[f"maj@{K}"] = maj_at_k(correct, answers)
    return out


def transfer_matrix(tables: Sequence[np.ndarray]) -> np.ndarray:
    """f64[P, P]: entry (i, j) = fraction of prompts j solves (any correct sample) and i does not."""
    solved = np.stack([np.asarray(t, bool).any(1) for t in tables])   # [P, N]
    return (solved[None, :, :] & ~solved[:, None, :]).mean(-1)


def population_metrics(tables: Mapping[str, np.ndarray]) -> dict:
    """Population pass@k for k = 1, 2, ..., K and the pairwise transfer matrix of ``{policy: bool[N, K]}``."""
    names = list(tables)
    arrs = [np.asarray(tables[n], bool) for n in names]
    N, K = arrs[0].shape
    if any(a.shape[0] != N for a in arrs):
        raise ValueError("population metrics need every policy evaluated on the same prompts")
    K = min(a.shape[1] for a in arrs)
    out = {}
    for k in k_values(K):
        fail = np.ones(N)
        for a in arrs:
            fail *= 1.0 - pass_at_k_per_prompt(a.shape[1], a.sum(1), k)
        out[f"pass@{k}"] = float((1.0 - fail).mean())
    out["policies"] = names
    out["transfer"] = transfer_matrix(arrs).tolist()
    return out
