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
    Gram is factored in its own lower triangle (blocked, ``cholesky_lower_``), ``L⁻¹`` is formed in panels,
    and ``G`` is restored bit for bit from the other triangle, so no second ``n × n`` matrix exists: a merged
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

    The factor ``L`` of ``G + λI`` is made in the lower triangle (``cholesky_lower_``) while the strict
    upper triangle keeps ``G``; ``[(LLᵀ)⁻¹]_ii = Σ_k (L⁻¹)_ki²`` is read from ``n × block`` panels of
    ``L⁻¹`` (``inverse_panel``); then the lower triangle is copied back from the upper one and the saved
    diagonal restored. Blocked torch code rather than LAPACK ``potrf`` in place: scipy's 32-bit OpenBLAS
    crashes (SIGSEGV) on matrices of 2³¹ bytes or more (n ≳ 16,000; measured here)."""
    diagonal = gram.diagonal().clone()
    try:
        gram.diagonal().add_(ridge)
        cholesky_lower_(gram, block)
        size = gram.shape[0]
        inverse_diagonal = torch.empty(size, dtype=torch.float64)
        for start in range(0, size, block):
            panel = inverse_panel(gram, start, min(start + block, size), block)
            inverse_diagonal[start:start + block] = panel.pow_(2).sum(0)
    finally:
        _restore_lower_from_upper(gram, diagonal, block)
    return inverse_diagonal


def cholesky_lower_(matrix: torch.Tensor, block: int = 512) -> None:
    """Blocked right-looking Cholesky in place: the lower triangle of ``matrix`` (symmetric positive
    definite, read from its lower triangle) becomes ``L`` with ``LLᵀ = A``; the strict upper triangle is
    neither read nor written. Working memory: ``n × block`` panels."""
    size = matrix.shape[0]
    for k0 in range(0, size, block):
        k1 = min(k0 + block, size)
        diagonal_block = matrix[k0:k1, k0:k1]
        lower = torch.tril(diagonal_block)
        factor, info = torch.linalg.cholesky_ex(lower + torch.tril(lower, -1).T)
        if int(info):
            raise torch.linalg.LinAlgError(f"G + λI is not positive definite (leading minor {k0 + int(info)})")
        diagonal_block.copy_(torch.where(torch.ones_like(factor, dtype=torch.bool).tril(), factor, diagonal_block))
        if k1 == size:
            break
        panel = torch.linalg.solve_triangular(factor.T, matrix[k1:, k0:k1], upper=True, left=False)
        matrix[k1:, k0:k1] = panel
        for j0 in range(k1, size, block):  # trailing update of the lower triangle only
            j1 = min(j0 + block, size)
            rows = panel[j0 - k1:j1 - k1]
            matrix[j0:j1, j0:j1].sub_(torch.tril(rows @ rows.T))
            if j1 < size:
                matrix[j1:, j0:j1].sub_(panel[j1 - k1:] @ rows.T)


def inverse_panel(factor: torch.Tensor, start: int, stop: int, block: int = 512) -> torch.Tensor:
    """Rows ``start:`` of columns ``start:stop`` of ``L⁻¹`` (rows above ``start`` are zero) for the lower
    triangle ``L`` of ``factor``, by blocked forward substitution ``L X = E`` over row blocks. Leading
    dimensions are a batch (each matrix factored alone, the same operations batched)."""
    size = factor.shape[-1]
    panel = factor.new_zeros(*factor.shape[:-2], size - start, stop - start)
    for r0 in range(start, size, block):
        r1 = min(r0 + block, size)
        rhs = panel[..., r0 - start:r1 - start, :]
        if r0 < stop:
            rhs[..., r0 - start:r1 - start] += torch.eye(r1 - r0, dtype=factor.dtype, device=factor.device)
        if r0 > start:
            rhs -= factor[..., r0:r1, start:r0] @ panel[..., :r0 - start, :]
        rhs.copy_(torch.linalg.solve_triangular(torch.tril(factor[..., r0:r1, r0:r1]), rhs, upper=False))
    return panel


def lower_triangular_inverse(factor: torch.Tensor, block: int = 512) -> torch.Tensor:
    """``L⁻¹`` of the lower triangle ``L`` of ``factor`` (leading dimensions: a batch), one column panel at a
    time (``inverse_panel``): ``n³/6`` multiply-adds, LAPACK ``trtri``'s count, which torch does not expose
    (a triangular solve against the identity costs ``n³/2``)."""
    size = factor.shape[-1]
    inverse = torch.zeros_like(factor)
    for start in range(0, size, block):
        stop = min(start + block, size)
        inverse[..., start:, start:stop] = inverse_panel(factor, start, stop, block)
    return inverse


def _restore_lower_from_upper(gram: torch.Tensor, diagonal: torch.Tensor, block: int) -> None:
    """Symmetric ``gram`` again: lower triangle := transposed strict upper triangle, diagonal := saved."""
    size = gram.shape[0]
    for start in range(0, size, block):
        stop = min(start + block, size)
        gram[stop:, start:stop] = gram[start:stop, stop:].T
        square = gram[start:stop, start:stop]
        upper = torch.triu(square, diagonal=1)
        square.copy_(upper + upper.T)
        square.diagonal().copy_(diagonal[start:stop])


def submatrix(matrix: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``matrix[rows][:, columns]`` gathered in one step (no ``|rows| × n`` intermediate)."""
    return matrix[rows.unsqueeze(1), columns.unsqueeze(0)]


def ridge_compensation(weight: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor,
                       ridge: float, block: int = 512) -> torch.Tensor:
    """Kept columns refitted by ridge least squares (FlattenGPT Theorem 3.1, torch orientation).

    ``W'_K = W_K + W_D G_DK (G_KK + λI)⁻¹`` minimises ``‖X_K W'_Kᵀ − X Wᵀ‖² + λ‖W'_K − W_K‖²``, i.e. the
    stacked problem ``[X_K; √λ I] ΔWᵀ = [X_D W_Dᵀ; 0]``. Returns ``W'_K`` (``out × |K|``, fp64).
    Working memory beside ``G``: ``G_KK`` (factored in place), the right-hand side (solved in place) and
    ``W_D`` in fp64 while the right-hand side is built; never ``W`` whole in fp64 or a ``|K| × |D|`` block.
    """
    gram = gram.to(torch.float64)
    drop = _complement(keep, gram.shape[0])
    # (G_KK + λI) Δᵀ = G_KD W_Dᵀ  →  Δ = W_D G_DK (G_KK + λI)⁻¹ (Cholesky: G_KK + λI is SPD for λ > 0)
    dropped = weight[:, drop].T.to(torch.float64)
    rhs = torch.empty(len(keep), weight.shape[0], dtype=torch.float64, device=gram.device)
    for start in range(0, len(keep), block):
        torch.matmul(submatrix(gram, keep[start:start + block], drop), dropped, out=rhs[start:start + block])
    del dropped
    system = submatrix(gram, keep, keep)
    system.diagonal().add_(ridge)
    delta = spd_solve_(system, rhs, overwrite=True)
    del system
    return weight[:, keep].to(torch.float64).add_(delta.T)


def obs_kept_columns(weight: torch.Tensor, gram: torch.Tensor, keep_count: int, ridge: float,
                     block: int = 16) -> torch.Tensor:
    """The ``keep_count`` input columns of ``weight`` left by greedy Optimal Brain Surgeon elimination (ZipLM,
    Kurtic et al. 2023; SlimGPT's structured OBS, Ling et al. 2024), ascending.

    With ``H = G + λI`` and the current compensated weight ``W``, removing column ``j`` (and refitting the rest)
    raises ``tr((W' − W) H (W' − W)ᵀ)`` by ``‖W_:,j‖² / [H⁻¹]_jj``. Each step drops the ``block`` columns of least
    increase at once, then ``W −= W_:,S ([H⁻¹]_SS)⁻¹ [H⁻¹]_S,:`` and ``H⁻¹ −= [H⁻¹]_:,S ([H⁻¹]_SS)⁻¹ [H⁻¹]_S,:``
    (the inverse over the survivors). ``block: 1`` is exact greedy; the compensated kept columns are
    :func:`ridge_compensation`'s. Unlike ridge leverage, the choice weighs each column by the weight reading
    it. Working memory beside ``G``: the factor of ``H`` then ``H⁻¹`` (``n × n`` fp64 each) and ``W`` in fp64."""
    size = gram.shape[0]
    factor = gram.to(torch.float64, copy=True)
    factor.diagonal().add_(ridge)
    info = torch.empty((), dtype=torch.int32, device=factor.device)
    torch.linalg.cholesky_ex(factor, out=(factor, info))  # in place: beside G only the factor, then H⁻¹
    _check_factored(int(info))
    inverse = torch.cholesky_inverse(factor)
    del factor
    current = weight.detach().to(torch.float64, copy=True)
    alive = torch.ones(size, dtype=torch.bool, device=gram.device)
    for removed in range(0, size - keep_count, block):
        count = min(block, size - keep_count - removed)
        cost = current.pow(2).sum(0) / inverse.diagonal()
        cost[~alive] = torch.inf
        step = cost.topk(count, largest=False).indices
        # ([H⁻¹]_SS)⁻¹ [H⁻¹]_S,: by Cholesky (SPD: a principal block of an SPD matrix)
        rows = torch.cholesky_solve(inverse[step], torch.linalg.cholesky(submatrix(inverse, step, step)))
        current.addmm_(current[:, step], rows, alpha=-1)
        inverse.addmm_(inverse[:, step], rows, alpha=-1)
        alive[step] = False
    return alive.nonzero().flatten()


def spd_solve_(system: torch.Tensor, rhs: torch.Tensor, block: int = 512,
               overwrite: bool = False) -> torch.Tensor:
    """``A⁻¹ B`` for a symmetric positive definite fp64 ``A`` by Cholesky, overwriting ``A`` with its factor:
    on CPU blocked in place (``cholesky_lower_``, then blocked forward and back substitution), so no second
    ``n × n`` matrix; a factor copy elsewhere. ``overwrite``: on that CPU path an fp64 ``B`` the caller
    owns becomes the solution (no copy); elsewhere the solution is a new tensor either way."""
    if system.device.type == "cpu" and system.dtype == torch.float64 and system.is_contiguous():
        cholesky_lower_(system, block)
        size = system.shape[0]
        solution = rhs if overwrite and rhs.dtype == torch.float64 else rhs.to(torch.float64, copy=True)
        for r0 in range(0, size, block):  # L Y = B
            r1 = min(r0 + block, size)
            if r0:
                solution[r0:r1] -= system[r0:r1, :r0] @ solution[:r0]
            solution[r0:r1] = torch.linalg.solve_triangular(torch.tril(system[r0:r1, r0:r1]), solution[r0:r1],
                                                            upper=False)
        for r1 in range(size, 0, -block):  # Lᵀ X = Y
            r0 = max(r1 - block, 0)
            if r1 < size:
                solution[r0:r1] -= system[r1:, r0:r1].T @ solution[r1:]
            solution[r0:r1] = torch.linalg.solve_triangular(torch.tril(system[r0:r1, r0:r1]).T, solution[r0:r1],
                                                            upper=True)
        return solution
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
