"""GPTQ against an independent fp64 reference (OBS elimination form, no Cholesky, no blocks) and RTN."""
import math

import pytest
import torch

from recipe_engine.modifiers._quant import Grid, output_error, rtn
from recipe_engine.modifiers.gptq import gptq_quantize


def minmax_params(x, bits, sym):
    """GPTQ reference quantizer grid of one group ``x`` [rows, cols]: (scale, zero) per row."""
    lo, hi = x.min(1).values.clamp(max=0), x.max(1).values.clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scale = (hi - lo) / (2 ** bits - 1)
    zero = torch.full_like(scale, 2 ** (bits - 1)) if sym else torch.round(-lo / scale)
    return scale, zero


def quantize_column(w, scale, zero, bits):
    return scale * (torch.clamp(torch.round(w / scale) + zero, 0, 2 ** bits - 1) - zero)


def reference_gptq(weight, gram, bits, group, sym, act_order, damp):
    """Optimal Brain Quantization order-constrained (GPTQ §3-4) written as explicit elimination: after
    quantizing column j, all remaining columns move by ``-e H⁻¹[j, :]`` with ``e = (w_j - q_j) / H⁻¹[j, j]``
    and column j is eliminated from ``H⁻¹`` (Gaussian elimination, GPTQ eq. 3)."""
    w = weight.double().clone()
    h = gram.double().clone()
    n = w.shape[1]
    group = group or n
    hinv = torch.linalg.inv(h + damp * torch.diagonal(h).mean() * torch.eye(n, dtype=torch.float64))
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(n)
    params = {}
    if act_order or group == n:
        params = {g: minmax_params(w[:, g * group:(g + 1) * group], bits, sym) for g in range(n // group)}
    out = torch.zeros_like(w)
    for j in order.tolist():
        if j % group == 0 and not (act_order or group == n):
            params[j // group] = minmax_params(w[:, j:j + group], bits, sym)
        q = quantize_column(w[:, j], *params[j // group], bits)
        e = (w[:, j] - q) / hinv[j, j]
        w -= e[:, None] * hinv[j][None, :]
        hinv -= hinv[:, j:j + 1] @ hinv[j:j + 1, :] / hinv[j, j]
        out[:, j] = q
    return out


def correlated_problem(rows=24, cols=64, tokens=512, seed=0):
    """A weight and the input gram of correlated, unequally scaled features (like LLM activations)."""
    g = torch.Generator().manual_seed(seed)
    factors = torch.randn(tokens, cols // 4, generator=g, dtype=torch.float64)
    x = factors @ torch.randn(cols // 4, cols, generator=g, dtype=torch.float64)
    x += 0.3 * torch.randn(tokens, cols, generator=g, dtype=torch.float64)
    x *= torch.logspace(-1, 1, cols, dtype=torch.float64)
    weight = torch.randn(rows, cols, generator=g)
    # A group's scale is set when its first column is reached; if that column held the group's negative
    # absmax it would sit exactly on the symmetric grid's rounding tie (-2^(b-1) + 1/2) and 1e-16 noise
    # between two correct implementations could pick either neighbour. Small first columns avoid ties.
    weight[:, ::8] *= 0.1
    return weight, x.T @ x


@pytest.mark.parametrize("bits,group,sym,act_order", [
    (4, 16, True, False), (4, 16, False, False), (3, 8, True, True), (4, 16, False, True),
    (4, None, True, False), (2, 32, False, False)])
@pytest.mark.parametrize("block", [32, 128])
def test_gptq_equals_reference(bits, group, sym, act_order, block):
    weight, gram = correlated_problem()
    got = gptq_quantize(weight, gram, Grid(bits, group, sym), act_order, damp=0.01, block_size=block)
    expected = reference_gptq(weight, gram, bits, group, sym, act_order, damp=0.01)
    torch.testing.assert_close(got.dequantized, expected, rtol=0, atol=1e-9)


@pytest.mark.parametrize("group,sym", [(16, True), (16, False), (None, True)])
def test_gptq_values_on_their_group_grid(group, sym):
    weight, gram = correlated_problem()
    grid = Grid(4, group, sym)
    got = gptq_quantize(weight, gram, grid, act_order=True, damp=0.01, block_size=128)
    scale, zero = grid.expand(got.scale, 64), grid.expand(got.zero, 64)
    code = got.dequantized / scale + zero
    torch.testing.assert_close(code, code.round(), rtol=0, atol=1e-9)
    assert code.min() >= -1e-9 and code.max() <= 15 + 1e-9


@pytest.mark.parametrize("group,sym,act_order", [(16, True, False), (16, False, False), (8, True, True),
                                                  (None, False, False)])
def test_gptq_beats_rtn_on_layer_output(group, sym, act_order):
    weight, gram = correlated_problem(seed=1)
    grid = Grid(4, group, sym)
    gptq = gptq_quantize(weight, gram, grid, act_order, damp=0.01, block_size=128)
    baseline = rtn(weight, grid)
    gptq_error = output_error(weight, gptq.dequantized, gram)
    rtn_error = output_error(weight, baseline.dequantized, gram)
    assert gptq_error < 0.8 * rtn_error, (gptq_error, rtn_error)


def test_gptq_dead_inputs_zeroed_and_deterministic():
    weight, gram = correlated_problem()
    gram[5, :] = gram[:, 5] = 0
    first = gptq_quantize(weight, gram, Grid(4, 16, True), act_order=False, damp=0.01, block_size=128)
    second = gptq_quantize(weight, gram, Grid(4, 16, True), act_order=False, damp=0.01, block_size=128)
    assert torch.all(first.dequantized[:, 5] == 0)
    assert torch.equal(first.dequantized, second.dequantized)


@pytest.mark.parametrize("size,block", [(7, 512), (300, 64), (257, 128)])
def test_inverse_hessian_factor_is_the_upper_cholesky_factor_of_the_damped_inverse(size, block):
    """The reversed-order factor ``P L⁻¹ P`` equals LAPACK's upper Cholesky factor of ``(H + λI)⁻¹`` (the
    reference code's chain); ``lower_triangular_inverse`` equals ``torch.linalg.inv`` of the triangle."""
    from recipe_engine.numerics.linalg import lower_triangular_inverse
    from recipe_engine.modifiers.gptq import inverse_hessian_factor

    g = torch.Generator().manual_seed(size)
    x = torch.randn(2 * size, size, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, size, dtype=torch.float64)
    h = x.T @ x
    damped = h + 0.01 * torch.diagonal(h).mean() * torch.eye(size, dtype=torch.float64)
    expected = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    assert torch.allclose(inverse_hessian_factor(h, 0.01), expected, rtol=1e-8, atol=1e-12 * expected.abs().max())
    lower = torch.linalg.cholesky(damped)
    inverse = lower_triangular_inverse(lower, block)
    assert torch.allclose(inverse, torch.linalg.inv(lower), rtol=1e-9, atol=1e-12 * inverse.abs().max())
    assert torch.equal(inverse, torch.tril(inverse))


@pytest.mark.parametrize("group,sym,act_order", [(16, True, True), (16, False, False), (None, True, False)])
def test_gptq_block_program_through_static_buffers_equals_the_eager_sweep(group, sym, act_order):
    """``graphs=True`` runs every block through ``_BlockGraph``'s static buffers (a CUDA graph replay on a
    GPU; here the same program over the same buffers): bit for bit the eager sweep, a short last block
    (96 columns, blocks of 64) and dynamic groups included."""
    weight, gram = correlated_problem(cols=96)
    grid = Grid(4, group, sym)
    eager = gptq_quantize(weight, gram, grid, act_order, damp=0.01, block_size=64, graphs=False)
    buffered = gptq_quantize(weight, gram, grid, act_order, damp=0.01, block_size=64, graphs=True)
    assert torch.equal(eager.dequantized, buffered.dequantized)
    assert torch.equal(eager.scale, buffered.scale) and torch.equal(eager.zero, buffered.zero)
    expected = reference_gptq(weight, gram, 4, group, sym, act_order, damp=0.01)
    torch.testing.assert_close(buffered.dequantized, expected, rtol=0, atol=1e-9)


def expert_problems(count=5, rows=24, cols=64):
    """``count`` weights with their own Hessians: correlated SPD Grams, one all-zero (no token: every input
    dead), one singular (rank 8 < 64 and two dead inputs)."""
    weights, grams = zip(*(correlated_problem(rows, cols, seed=seed) for seed in range(count)))
    weights, grams = torch.stack(weights), torch.stack(grams)
    grams[1] = 0.0
    x = torch.randn(8, cols, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grams[2] = x.T @ x
    grams[2, 7, :] = grams[2, :, 7] = grams[2, 40, :] = grams[2, :, 40] = 0.0
    return weights, grams


@pytest.mark.parametrize("group,sym,act_order", [(16, True, True), (16, False, False), (8, True, False),
                                                  (None, True, False), (32, False, True)])
@pytest.mark.parametrize("graphs", [False, True])
def test_batched_gptq_equals_one_weight_at_a_time(group, sym, act_order, graphs):
    """``gptq_quantize_batch`` over several weights, each with its own Hessian (incl. an all-zero and a singular
    one), equals ``gptq_quantize`` of each alone bit for bit: the same integer codes, scales and zero points, and
    so the same dequantized weights (dynamic groups, act_order, per-row groups, a short last block); each alone
    also matches the independent reference."""
    from recipe_engine.modifiers.gptq import gptq_quantize_batch

    weights, grams = expert_problems(cols=96)
    grid = Grid(4, group, sym)
    batched = gptq_quantize_batch(weights, grams, grid, act_order, damp=0.01, block_size=64, graphs=graphs)
    for index, (weight, gram) in enumerate(zip(weights, grams)):
        alone = gptq_quantize(weight, gram, grid, act_order, damp=0.01, block_size=64, graphs=graphs)
        assert torch.equal(batched.scale[index], alone.scale) and torch.equal(batched.zero[index], alone.zero)
        codes = grid.codes(batched.dequantized[index], grid.expand(alone.scale, 96), grid.expand(alone.zero, 96))
        assert torch.equal(codes, grid.codes(alone.dequantized, grid.expand(alone.scale, 96),
                                             grid.expand(alone.zero, 96)))
        assert torch.equal(batched.dequantized[index], alone.dequantized)
        dead = torch.diagonal(gram) == 0  # as the reference code: H_ii = 1, zero weights
        if dead.all():  # no token: every weight zero (the reference's grid has no all-zero group)
            assert not alone.dequantized.any()
            continue
        expected = reference_gptq(weight.masked_fill(dead, 0.0), torch.where(torch.diag(dead), 1.0, gram), 4, group,
                                  sym, act_order, damp=0.01)
        torch.testing.assert_close(alone.dequantized, expected, rtol=0, atol=1e-9)


def test_batched_gptq_names_the_hessian_that_is_not_positive_definite():
    from recipe_engine.modifiers.gptq import gptq_quantize_batch

    weights, grams = expert_problems(count=3)
    grams[2] = -torch.eye(64, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"Hessians \[2\] of the batch"):
        gptq_quantize_batch(weights, grams, Grid(4, 16, True), False, damp=0.01, block_size=64)


@pytest.mark.parametrize("act_order", [True, False])
def test_a_factored_hessian_and_kept_block_programs_give_the_same_weights(act_order):
    """Hessians factored once (``factor_hessians``, as for the gate/up stacks of a layer's experts) and block
    programs kept across calls (``BlockPrograms``: one per shape for the run) give each call's result bit for
    bit: two stacks of rows on one Hessian, the second reusing the first's factor and programs."""
    from recipe_engine.modifiers.gptq import BlockPrograms, factor_hessians, gptq_quantize_batch

    weights, grams = expert_problems(count=3, cols=96)
    gram, grid = grams[0], Grid(4, 16, True)
    factored, programs = factor_hessians(gram[None], act_order, damp=0.01), BlockPrograms()
    for stack in (weights[:2].reshape(1, 48, 96), weights[2:].reshape(1, 24, 96), weights[:2].reshape(1, 48, 96)):
        fresh = gptq_quantize_batch(stack, gram[None], grid, act_order, damp=0.01, block_size=64, graphs=True)
        kept = gptq_quantize_batch(stack, factored, grid, act_order, damp=0.01, block_size=64, graphs=True,
                                   programs=programs)
        assert torch.equal(fresh.dequantized, kept.dequantized)
        assert torch.equal(fresh.scale, kept.scale) and torch.equal(fresh.zero, kept.zero)
    assert len(programs.programs) == 4  # 48 and 24 rows, blocks of 64 and 32 columns: the third stack built none


def test_factored_hessians_carry_the_logged_damping():
    """``FactoredHessians.damping`` (the ``damping`` column of quantization_log.csv) is ``damp · mean(diag H)``
    with an input never seen counted as 1, per Hessian of the batch, as written out by hand here."""
    from recipe_engine.modifiers.gptq import factor_hessians

    grams = torch.stack([correlated_problem(8, 32, seed=seed)[1] for seed in (1, 2)])
    grams[1][5, :] = 0.0
    grams[1][:, 5] = 0.0  # input 5 of the second Hessian never seen
    factored = factor_hessians(grams, act_order=True, damp=0.05)
    for gram, damping in zip(grams, factored.damping):
        diagonal = [float(gram[i, i]) or 1.0 for i in range(32)]
        assert math.isclose(float(damping), 0.05 * sum(diagonal) / 32, rel_tol=1e-12)
    assert factored.dead[1].tolist() == [i == 5 for i in range(32)] and not factored.dead[0].any()
