"""recipe_engine.numerics.linalg against independent references (lstsq on the stacked ridge problem, explicit
inverses)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe_engine.numerics.linalg import (mean_eigenvalue, obs_kept_columns, reconstruction_error,
                                          ridge_compensation, ridge_leverage_scores, ridge_refit, spd_solve_)


def correlated_inputs(tokens=200, channels=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(channels, channels, generator=generator, dtype=torch.float64)
    return torch.randn(tokens, channels, generator=generator, dtype=torch.float64) @ mixing


def test_ridge_compensation_equals_stacked_lstsq():
    x = correlated_inputs()
    weight = torch.randn(5, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    keep = torch.tensor([0, 3, 4, 7, 8, 11])
    drop = torch.tensor([1, 2, 5, 6, 9, 10])
    ridge = 3.7
    # [X_K; √λ I] Δᵀ = [X_D W_Dᵀ; 0]
    lhs = torch.cat([x[:, keep], ridge ** 0.5 * torch.eye(len(keep), dtype=torch.float64)])
    rhs = torch.cat([x[:, drop] @ weight[:, drop].T, torch.zeros(len(keep), 5, dtype=torch.float64)])
    delta = torch.linalg.lstsq(lhs, rhs).solution.T
    for block in (512, 4):  # one panel of G_KD, then panels of 4 kept rows (the last one partial)
        got = ridge_compensation(weight, x.T @ x, keep, ridge, block=block)
        torch.testing.assert_close(got, weight[:, keep] + delta, rtol=1e-9, atol=1e-9)


def test_ridge_compensation_without_ridge_is_least_squares_optimum():
    x = correlated_inputs()
    weight = torch.randn(4, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    keep = torch.arange(0, 12, 2)
    fitted = torch.linalg.lstsq(x[:, keep], x @ weight.T).solution.T
    torch.testing.assert_close(ridge_compensation(weight, x.T @ x, keep, 0.0), fitted, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("block", [1, 5, 2048])  # panels of L⁻¹: one column, uneven, all at once
def test_leverage_scores_match_explicit_inverse(block):
    x = correlated_inputs()
    gram = x.T @ x
    ridge = 10 * mean_eigenvalue(gram)
    expected = torch.diagonal(gram @ torch.linalg.inv(gram + ridge * torch.eye(12, dtype=torch.float64)))
    before = gram.clone()
    torch.testing.assert_close(ridge_leverage_scores(gram, ridge, block), expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(gram, before)  # factored in place, then restored bit for bit
    # the copy path (GPU, other dtypes, non-contiguous) gives the same scores
    copy_path = ridge_leverage_scores(gram.T.contiguous().T.clone().t(), ridge, block)
    torch.testing.assert_close(copy_path, expected, rtol=1e-10, atol=1e-12)
    assert torch.all((expected > 0) & (expected < 1))
    eigen_mean = torch.linalg.eigvalsh(gram).mean().item()
    assert abs(mean_eigenvalue(gram) - eigen_mean) < 1e-10 * eigen_mean


def test_reconstruction_error_matches_residual_norm():
    x = correlated_inputs()
    weight = torch.randn(5, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    keep = torch.tensor([1, 2, 3, 9])
    gram = x.T @ x
    plain = ((x[:, keep] @ weight[:, keep].T - x @ weight.T) ** 2).sum()
    assert abs(reconstruction_error(weight, gram, keep, None) - float(plain)) < 1e-8 * float(plain)
    refit = ridge_compensation(weight, gram, keep, 0.5)
    fitted = ((x[:, keep] @ refit.T - x @ weight.T) ** 2).sum()
    assert abs(reconstruction_error(weight, gram, keep, 0.5) - float(fitted)) < 1e-8 * float(fitted)
    assert fitted < plain


def test_refit_error_and_heldout_scale_match_explicit_fits():
    """Moments-only errors against residuals of explicit ridge fits (lstsq on the stacked problem);
    the chosen multiple against brute force over the grid."""
    from recipe_engine.numerics.linalg import heldout_ridge_scale, refit_error

    generator = torch.Generator().manual_seed(4)
    x = correlated_inputs(tokens=45, channels=12, seed=5)
    e = x @ torch.randn(12, 3, generator=generator, dtype=torch.float64) \
        + 20 * torch.randn(45, 3, generator=generator, dtype=torch.float64)
    folds = [torch.arange(0, 15), torch.arange(15, 30), torch.arange(30, 45)]
    grams = [x[f].T @ x[f] for f in folds]
    crosses = [x[f].T @ e[f] for f in folds]
    errors = [float((e[f] ** 2).sum()) for f in folds]
    delta = torch.randn(3, 12, generator=generator, dtype=torch.float64)
    explicit = float(((e[folds[0]] - x[folds[0]] @ delta.T) ** 2).sum())
    assert abs(refit_error(errors[0], grams[0], crosses[0], delta) - explicit) < 1e-9 * explicit

    scales = [1e-4, 0.1, 1.0, 10.0, 1000.0]
    brute = []
    for scale in scales:
        total = 0.0
        for k, held in enumerate(folds):
            fit = torch.cat([f for j, f in enumerate(folds) if j != k])
            ridge = scale * float(torch.diagonal(x[fit].T @ x[fit]).mean())
            lhs = torch.cat([x[fit], ridge ** 0.5 * torch.eye(12, dtype=torch.float64)])
            rhs = torch.cat([e[fit], torch.zeros(12, 3, dtype=torch.float64)])
            solution = torch.linalg.lstsq(lhs, rhs).solution
            total += float(((e[held] - x[held] @ solution) ** 2).sum())
        brute.append(total)
    chosen, held = heldout_ridge_scale(grams, crosses, errors, scales)
    torch.testing.assert_close(torch.tensor(held), torch.tensor(brute), rtol=1e-8, atol=0.0)
    assert chosen == scales[brute.index(min(brute))]
    assert chosen not in (scales[0], scales[-1])  # noisy targets: neither no ridge nor no fit wins


@pytest.mark.parametrize("block", [3, 2048])
def test_leverage_in_place_restores_gram_when_not_positive_definite(block):
    x = correlated_inputs()
    gram = x.T @ x
    gram[4, 4] = -1e6  # indefinite even with the ridge
    before = gram.clone()
    with pytest.raises(torch.linalg.LinAlgError, match="not positive definite"):
        ridge_leverage_scores(gram, 1.0, block)
    assert torch.equal(gram, before)


LEVERAGE_PEAK_PROBE = """
import sys, torch, scipy.linalg  # imported before the baseline
from recipe_engine.numerics.linalg import ridge_leverage_scores
n, contiguous = int(sys.argv[1]), sys.argv[2] == "in-place"
x = torch.randn(n + 200, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
gram = x.T @ x
del x
gram = gram if contiguous else gram.T  # a transposed view takes the copy path
warm = torch.eye(300, dtype=torch.float64)
ridge_leverage_scores(warm if contiguous else warm.T, 1.0, 256)  # LAPACK/BLAS buffers before the baseline
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS counter
base = status("VmRSS:")
ridge_leverage_scores(gram, float(gram.diagonal().mean()), 128)
print((status("VmHWM:") - base) / (n * n * 8))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_leverage_in_place_allocates_no_second_matrix():
    """Peak RSS during the call, in units of one n × n fp64 matrix: the in-place path stays well under
    one (panels only); the copy path needs at least one (measured side by side, n = 3000)."""
    def peak(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", LEVERAGE_PEAK_PROBE, "3000", mode], check=True,
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return float(out.stdout.strip().splitlines()[-1])

    in_place, copied = peak("in-place"), peak("copy")
    assert in_place < 0.5 <= 1.0 <= copied, (in_place, copied)


def test_ridge_refit_equals_stacked_lstsq():
    """``W' = W + ((G + λI)⁻¹ C)ᵀ`` minimises ‖XW'ᵀ − Y*‖² + λ‖W' − W‖²: lstsq on [X; √λI] Δᵀ = [E; 0]."""
    x = correlated_inputs()
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(5, 12, generator=generator, dtype=torch.float64)
    target = torch.randn(x.shape[0], 5, generator=generator, dtype=torch.float64)
    errors, ridge = target - x @ weight.T, 0.7
    stacked = torch.cat([x, ridge ** 0.5 * torch.eye(12, dtype=torch.float64)])
    rhs = torch.cat([errors, torch.zeros(12, 5, dtype=torch.float64)])
    expected = weight + torch.linalg.lstsq(stacked, rhs).solution.T
    gram = x.T @ x
    before = gram.clone()
    torch.testing.assert_close(ridge_refit(weight, gram, x.T @ errors, ridge), expected, rtol=1e-9, atol=1e-9)
    assert torch.equal(gram, before)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])  # in-place LAPACK, torch copy path
def test_spd_solve_matches_general_solve(layout):
    x = correlated_inputs()
    system = x.T @ x + 0.5 * torch.eye(12, dtype=torch.float64)
    rhs = torch.randn(12, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expected = torch.linalg.solve(system, rhs)
    given = system.clone() if layout == "contiguous" else system.clone().T
    torch.testing.assert_close(spd_solve_(given, rhs), expected, rtol=1e-10, atol=1e-10)


def test_spd_solve_overwrite_solves_in_the_callers_right_hand_side():
    """``overwrite=True`` returns the solution in ``rhs``'s own storage (ridge_compensation's saving);
    by default ``rhs`` is left as given."""
    x = correlated_inputs()
    system = x.T @ x + 0.5 * torch.eye(12, dtype=torch.float64)
    rhs = torch.randn(12, 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    expected = torch.linalg.solve(system, rhs)
    given = rhs.clone()
    kept = spd_solve_(system.clone(), given)
    assert torch.equal(given, rhs) and kept.data_ptr() != given.data_ptr()
    solved = spd_solve_(system.clone(), given, block=5, overwrite=True)
    assert solved.data_ptr() == given.data_ptr()
    torch.testing.assert_close(given, expected, rtol=1e-10, atol=1e-10)


def ridge_objective(x, weight, keep, ridge):
    """``min_{W'_K} ‖X_K W'_Kᵀ − X Wᵀ‖² + λ‖W'_K − W_K‖² + λ‖W_D‖²`` (``W'_D = 0``) by lstsq on the stacked
    problem: the cost OBS elimination charges, ``tr((W' − W)(G + λI)(W' − W)ᵀ)``."""
    drop = torch.tensor([c for c in range(x.shape[1]) if c not in set(keep)], dtype=torch.long)
    lhs = torch.cat([x[:, keep], ridge ** 0.5 * torch.eye(len(keep), dtype=torch.float64)])
    rhs = torch.cat([x[:, drop] @ weight[:, drop].T, torch.zeros(len(keep), weight.shape[0], dtype=torch.float64)])
    residual = lhs @ torch.linalg.lstsq(lhs, rhs).solution - rhs
    return float(residual.pow(2).sum()) + ridge * float(weight[:, drop].pow(2).sum())


def brute_force_greedy(x, weight, keep_count, ridge):
    """Backward elimination by trying every single drop with a full lstsq refit: the kept columns."""
    kept = list(range(x.shape[1]))
    while len(kept) > keep_count:
        costs = [ridge_objective(x, weight, [c for c in kept if c != j], ridge) for j in kept]
        kept.remove(kept[min(range(len(kept)), key=costs.__getitem__)])
    return kept


def test_obs_elimination_is_the_brute_force_greedy_and_its_weight_the_ridge_refit():
    """``block: 1`` drops, step by step, the column whose removal (with a full ridge refit of the rest) costs
    least; a single block of every drop is the top of the first step's costs ``‖W_:,j‖² / [(G + λI)⁻¹]_jj``."""
    x = correlated_inputs(tokens=60, channels=14, seed=3)
    weight = torch.randn(6, 14, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    gram, ridge = x.T @ x, 0.5 * mean_eigenvalue(x.T @ x)
    kept = obs_kept_columns(weight, gram, 6, ridge, block=1)
    assert kept.tolist() == brute_force_greedy(x, weight, 6, ridge)
    assert kept.tolist() != ridge_leverage_scores(gram, ridge).topk(6).indices.sort().values.tolist()
    inverse = torch.linalg.inv(gram + ridge * torch.eye(14, dtype=torch.float64))
    first = weight.pow(2).sum(0) / torch.diagonal(inverse)
    one_block = obs_kept_columns(weight, gram, 6, ridge, block=8)
    assert one_block.tolist() == first.topk(6).indices.sort().values.tolist()
    two_blocks = obs_kept_columns(weight, gram, 6, ridge, block=5)  # 5 then 3 dropped
    assert len(two_blocks) == 6 and two_blocks.tolist() == sorted(set(two_blocks.tolist()))
