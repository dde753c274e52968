"""Hadamard matrices: orthonormal, ±1/√n entries, the construction each size uses."""
import pytest
import torch

from recipe_engine.numerics.hadamard import hadamard, orthogonal, rotation

SIZES = {1: "walsh-hadamard(2^0)", 2: "walsh-hadamard(2^1)", 12: "paley1(p=11)", 20: "paley1(p=19)",
         28: "paley2(p=13)", 36: "paley2(p=17)", 40: "paley1(p=19)", 44: "paley1(p=43)", 60: "paley1(p=59)",
         576: "paley2(p=17) ⊗ walsh-hadamard(2^4)", 896: "paley2(p=13) ⊗ walsh-hadamard(2^5)",
         2048: "walsh-hadamard(2^11)", 4096: "walsh-hadamard(2^12)",
         5120: "paley1(p=19) ⊗ walsh-hadamard(2^8)", 1536: "paley1(p=11) ⊗ walsh-hadamard(2^7)",
         3584: "paley2(p=13) ⊗ walsh-hadamard(2^7)"}


@pytest.mark.parametrize("n", sorted(SIZES))
def test_hadamard_is_orthonormal_with_equal_magnitudes(n):
    h, name = hadamard(n)
    assert name.startswith(SIZES[n])
    signs = (h * n ** 0.5).round()
    torch.testing.assert_close(h * n ** 0.5, signs, rtol=0, atol=1e-9)   # entries ±1/√n
    assert torch.equal(signs.abs(), torch.ones(n, n, dtype=torch.float64))
    gram = signs.float() @ signs.float().T                                   # integers: exact in fp32
    assert torch.equal(gram, n * torch.eye(n))                               # so H Hᵀ = I


def test_unsupported_size_falls_back_to_named_seeded_orthogonal():
    assert hadamard(52) is None and hadamard(7) is None
    q, name = rotation(52, seed=3)
    assert name == "random-orthogonal(seed=3)"
    torch.testing.assert_close(q @ q.T, torch.eye(52, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(q, orthogonal(52, 3)) and not torch.equal(q, orthogonal(52, 4))


def test_walsh_hadamard_matches_sylvester_recursion():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    expected = torch.kron(h2, torch.kron(h2, h2)) / 8 ** 0.5
    assert torch.equal(hadamard(8)[0], expected)
