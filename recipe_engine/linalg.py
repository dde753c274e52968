"""Ridge-regularised column selection and compensation shared by pruning steps (fp64 throughout).

Notation follows torch's ``Linear``: a weight ``W`` is ``out × in`` and reads inputs ``x`` (rows of ``X``,
``tokens × in``). ``G = XᵀX`` is the input Gram matrix (``stats.InputCovariance.gram``). Pruning keeps the
input channels ``K`` and drops ``D``; compensation refits the kept columns so that ``X_K W'_Kᵀ ≈ X Wᵀ``.
"""
from __future__ import annotations

import torch


def mean_eigenvalue(gram: torch.Tensor) -> float:
    """Mean eigenvalue of a symmetric PSD matrix: ``trace(G) / n``."""
    return float(torch.diagonal(gram).sum()) / gram.shape[0]


def ridge_leverage_scores(gram: torch.Tensor, ridge: float, block: int = 512) -> torch.Tensor:
    """Ridge leverage scores ``s_i = [G (G + λI)⁻¹]_ii`` (Musco & Musco 2017; FlattenGPT Alg. 3 line 2).

    ``G (G + λI)⁻¹ = I − λ (G + λI)⁻¹``; with ``G + λI = LLᵀ``, ``[(LLᵀ)⁻¹]_ii = Σ_k (L⁻¹)_ki²``. A CPU fp64
    Gram is factored and inverted in its own storage (LAPACK ``potrf`` and ``trtri`` on one triangle) and
    restored bit for bit from the other triangle, so no second ``n × n`` matrix exists: a merged
    Llama-3-8B MLP (n = 28672) needs ``G`` (6.6 GB) plus ``n × block`` panels. Elsewhere (GPU, other dtypes)
    one factor copy is made and ``L⁻¹`` is solved in ``n × block`` panels.
    """
    if gram.device.type == "cpu" and gram.dtype == torch.float64 and gram.is_contiguous():
        return 1.0 - ridge * _inverse_diagonal_in_place(gram, ridge, block)
    factor = gram.to(torch.float64, copy=True)
    factor.diagonal().add_(ridge)
    info = torch.empty((), dtype=torch.int32, device=factor.device)
    torch.linalg.cholesky_ex(factor, out=(factor, info))
    _check_factored(int(info))
    size = factor.shape[0]
    inverse_diagonal = torch.empty(size, dtype=torch.float64, device=factor.device)
    for start in range(0, size, block):
        stop = min(start + block, size)
        # columns start:stop of L⁻¹ are zero above row start: solve the trailing triangle only
        unit = torch.eye(size - start, stop - start, dtype=torch.float64, device=factor.device)
        panel = torch.linalg.solve_triangular(factor[start:, start:], unit, upper=False)
        inverse_diagonal[start:stop] = panel.pow(2).sum(0)
    return 1.0 - ridge * inverse_diagonal


def _check_factored(info: int) -> None:
    if info > 0:
        raise torch.linalg.LinAlgError(f"G + λI is not positive definite (leading minor {info})")
    if info < 0:
        raise RuntimeError(f"LAPACK argument {-info} invalid")


def _inverse_diagonal_in_place(gram: torch.Tensor, ridge: float, block: int) -> torch.Tensor:
    """``diag((G + λI)⁻¹)`` computed in the storage of the C-ordered CPU fp64 ``gram``, which is restored.

    The Fortran view ``Gᵀ`` (equal to ``G``) is factored in its lower triangle — the row-major upper
    triangle of ``gram`` — while the row-major strict lower triangle keeps ``G``; afterwards the upper
    triangle is copied back from it and the saved diagonal restored."""
    from scipy.linalg import lapack

    diagonal = gram.diagonal().clone()
    column_major = gram.numpy().T
    try:
        gram.diagonal().add_(ridge)
        _, info = lapack.dpotrf(column_major, lower=1, clean=0, overwrite_a=1)
        _check_factored(info)
        _, info = lapack.dtrtri(column_major, lower=1, overwrite_c=1)
        _check_factored(info)
        size = gram.shape[0]
        # row i of the row-major upper triangle is column i of L⁻¹ (entries k ≥ i)
        inverse_diagonal = torch.empty(size, dtype=torch.float64)
        panel = torch.empty(min(block, size), size, dtype=torch.float64)  # one buffer: no heap growth
        for start in range(0, size, block):
            rows = panel[:min(block, size - start)]
            torch.triu(gram[start:start + block], diagonal=start, out=rows)
            inverse_diagonal[start:start + block] = rows.pow_(2).sum(1)
    finally:
        _restore_upper_from_lower(gram, diagonal, block)
    return inverse_diagonal


def _restore_upper_from_lower(gram: torch.Tensor, diagonal: torch.Tensor, block: int) -> None:
    """Symmetric ``gram`` again: upper triangle := transposed strict lower triangle, diagonal := saved."""
    size = gram.shape[0]
    for start in range(0, size, block):
        stop = min(start + block, size)
        gram[start:stop, stop:] = gram[stop:, start:stop].T
        square = gram[start:stop, start:stop]
        lower = torch.tril(square, diagonal=-1)
        square.copy_(lower + lower.T)
        square.diagonal().copy_(diagonal[start:stop])


def submatrix(matrix: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``matrix[rows][:, columns]`` gathered in one step (no ``|rows| × n`` intermediate)."""
    return matrix[rows.unsqueeze(1), columns.unsqueeze(0)]


def ridge_compensation(weight: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor,
                       ridge: float) -> torch.Tensor:
    """Kept columns refitted by ridge least squares (FlattenGPT Theorem 3.1, torch orientation).

    ``W'_K = W_K + W_D G_DK (G_KK + λI)⁻¹`` minimises ``‖X_K W'_Kᵀ − X Wᵀ‖² + λ‖W'_K − W_K‖²``, i.e. the
    stacked problem ``[X_K; √λ I] ΔWᵀ = [X_D W_Dᵀ; 0]``. Returns ``W'_K`` (``out × |K|``, fp64).
    """
    gram = gram.to(torch.float64)
    weight = weight.to(torch.float64)
    drop = _complement(keep, gram.shape[0])
    # (G_KK + λI) Δᵀ = G_KD W_Dᵀ  →  Δ = W_D G_DK (G_KK + λI)⁻¹ (Cholesky: G_KK + λI is SPD for λ > 0)
    rhs = submatrix(gram, keep, drop) @ weight[:, drop].T
    system = submatrix(gram, keep, keep)
    system.diagonal().add_(ridge)
    return weight[:, keep] + spd_solve_(system, rhs).T


def spd_solve_(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``A⁻¹ B`` for a symmetric positive definite fp64 ``A`` by Cholesky, overwriting ``A`` with its factor
    (LAPACK ``potrf``/``potrs`` in place on CPU, so no second ``n × n`` matrix; a factor copy elsewhere)."""
    if system.device.type == "cpu" and system.dtype == torch.float64 and system.is_contiguous():
        from scipy.linalg import lapack

        column_major = system.numpy().T  # the same symmetric matrix, Fortran order
        _, info = lapack.dpotrf(column_major, lower=1, clean=0, overwrite_a=1)
        _check_factored(info)
        solution, info = lapack.dpotrs(column_major, rhs.to(torch.float64).numpy(), lower=1)
        _check_factored(info)
        return torch.from_numpy(solution)
    return torch.cholesky_solve(rhs.to(system.dtype), torch.linalg.cholesky(system))


def ridge_refit(weight: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> torch.Tensor:
    """Weight moved towards a new target: ``W' = W + ((G + λI)⁻¹ C)ᵀ`` with ``C = Σ_t x_t e_tᵀ`` the
    cross-moment of the inputs and the current output errors ``e = y* − W x`` (fp64).

    Minimises ``‖X W'ᵀ − Y*‖² + λ‖W' − W‖²``: ridge least squares shrunk towards the current weight.
    """
    system = gram.to(torch.float64, copy=True)
    system.diagonal().add_(ridge)
    return weight.to(torch.float64) + spd_solve_(system, cross.to(torch.float64)).T


def refit_error(error: float, gram: torch.Tensor, cross: torch.Tensor, delta: torch.Tensor) -> float:
    """``‖E − X Δᵀ‖²_F = ‖E‖² − 2⟨C, Δᵀ⟩ + tr(Δ G Δᵀ)`` from the moments ``G = XᵀX``, ``C = XᵀE`` and
    ``error = ‖E‖²``: the error left after adding ``Δ`` (``out × in``) to a weight whose errors were ``E``."""
    delta = delta.to(torch.float64)
    return (error - 2 * float((cross.to(torch.float64) * delta.T).sum())
            + float(torch.einsum("oi,ij,oj->", delta, gram.to(torch.float64), delta)))


def heldout_ridge_scale(grams: list[torch.Tensor], crosses: list[torch.Tensor], errors: list[float],
                        scales: list[float]) -> tuple[float, list[float]]:
    """Ridge multiple chosen by K-fold cross-validation of the refit ``Δᵀ = (G + λI)⁻¹ C``.

    Fold ``f`` holds the moments ``G_f, C_f, ‖E_f‖²`` of disjoint calibration batches. For each multiple
    ``s`` and fold ``f``: fit on the other folds (``λ = s × mean eig`` of their Gram), measure the error left
    on fold ``f``; returns the multiple with the least summed held-out error and every multiple's sum.
    """
    gram_all, cross_all = sum(grams), sum(crosses)
    held = []
    for scale in scales:
        total = 0.0
        for gram, cross, error in zip(grams, crosses, errors):
            fit_gram = gram_all - gram
            eye = torch.eye(fit_gram.shape[0], dtype=torch.float64, device=fit_gram.device)
            factor = torch.linalg.cholesky(fit_gram + scale * mean_eigenvalue(fit_gram) * eye)
            delta_t = torch.cholesky_solve(cross_all - cross, factor)
            total += refit_error(error, gram, cross, delta_t.T)
        held.append(total)
    return scales[min(range(len(scales)), key=lambda k: (held[k], k))], held


def reconstruction_error(weight: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor,
                         ridge: float | None) -> float:
    """``‖X_K W'_Kᵀ − X Wᵀ‖²_F`` for the kept columns ``K``: with ``W'_K`` from :func:`ridge_compensation`
    when ``ridge`` is given, else the plain slice ``W'_K = W_K`` (then it equals ``tr(W_D G_DD W_Dᵀ)``)."""
    gram = gram.to(torch.float64)
    weight = weight.to(torch.float64)
    kept = ridge_compensation(weight, gram, keep, ridge) if ridge is not None else weight[:, keep]
    residual = -weight.clone()
    residual[:, keep] += kept
    return float(torch.einsum("oi,ij,oj->", residual, gram, residual))


def _complement(keep: torch.Tensor, size: int) -> torch.Tensor:
    mask = torch.ones(size, dtype=torch.bool, device=keep.device)
    mask[keep] = False
    return mask.nonzero().flatten()


@torch.no_grad()
def set_linear_weight(linear: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Replace a Linear's weight (and bias, when it has one) by new tensors of any shape, cast to its
    dtype, and update ``in_features`` / ``out_features``."""
    dtype, grad = linear.weight.dtype, linear.weight.requires_grad
    linear.weight = torch.nn.Parameter(weight.to(dtype).contiguous(), requires_grad=grad)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(bias.to(dtype).contiguous(), requires_grad=grad)
    linear.out_features, linear.in_features = weight.shape
