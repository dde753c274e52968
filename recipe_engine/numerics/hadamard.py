"""Orthonormal Hadamard matrices ``H`` (``H Hᵀ = I``) for rotating activations.

``hadamard(n)`` factors ``n = K · 2^m`` with the smallest ``K`` that has a construction and returns
``H_{2^m} ⊗ H_K / √n`` (Sylvester–Kronecker, as in QuaRot, Ashkboos et al. 2024):

* ``K = 1``: Walsh–Hadamard (Sylvester) only; ``H_2 = [[1, 1], [1, -1]]``, ``H_{2^m} = H_2 ⊗ H_{2^{m-1}}``.
* ``K = p + 1``, ``p`` prime, ``p ≡ 3 (mod 4)``: Paley I (12, 20, 24, 32, 44, 48, 60, 68, 72, 80, ...).
* ``K = 2(p + 1)``, ``p`` prime, ``p ≡ 1 (mod 4)``: Paley II (12, 28, 36, 60, 76, 100, ...).

Paley constructions here use prime fields only (the quadratic character is Legendre's symbol), so sizes
whose only factorisations need a prime power (e.g. 52 = 2 · 26 with 25 = 5²) have no Hadamard matrix here;
``orthogonal(n, seed)`` then gives a seeded random orthogonal matrix, and ``rotation`` says which was used.
Sizes of common models: 576 = 36 · 2⁴ (Paley II, p=17), 896 = 28 · 2⁵ (Paley II, p=13),
2048 and 4096 (Walsh–Hadamard), 5120 = 20 · 2⁸ (Paley I, p=19).
"""
from __future__ import annotations

import torch


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % d for d in range(2, int(p ** 0.5) + 1))


def _jacobsthal(p: int) -> torch.Tensor:
    """``Q[i, j] = χ(j − i)`` with Legendre's symbol χ over GF(p) (χ(0) = 0)."""
    squares = {(x * x) % p for x in range(1, p)}
    chi = torch.tensor([0.0] + [1.0 if r in squares else -1.0 for r in range(1, p)], dtype=torch.float64)
    index = (torch.arange(p)[None, :] - torch.arange(p)[:, None]) % p
    return chi[index]


def _paley(k: int) -> tuple[torch.Tensor, str] | None:
    """Unnormalised ±1 Hadamard matrix of order ``k`` from a Paley construction, or None."""
    if _is_prime(k - 1) and (k - 1) % 4 == 3:
        p = k - 1
        s = torch.zeros(k, k, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(p)
        return torch.eye(k, dtype=torch.float64) + s, f"paley1(p={p})"
    if k % 2 == 0 and _is_prime(k // 2 - 1) and (k // 2 - 1) % 4 == 1:
        p = k // 2 - 1
        c = torch.zeros(p + 1, p + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(p)
        one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, one) + torch.kron((c == 0).double(), zero), f"paley2(p={p})"
    return None


def _sylvester(m: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    for _ in range(m):
        h = torch.kron(h2, h)
    return h


def hadamard(n: int) -> tuple[torch.Tensor, str] | None:
    """Orthonormal ``H_{2^m} ⊗ H_K / √n`` (fp64) and its construction name, or None if unsupported."""
    power = (n & -n).bit_length() - 1          # largest m with 2^m | n
    for m in range(power, -1, -1):
        k = n >> m
        if k == 1:
            return _sylvester(m) / n ** 0.5, f"walsh-hadamard(2^{m})"
        built = _paley(k)
        if built is not None:
            return torch.kron(_sylvester(m), built[0]) / n ** 0.5, f"{built[1]} ⊗ walsh-hadamard(2^{m})"
    return None


def orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """Seeded random orthogonal matrix (fp64): QR of a Gaussian matrix with ``diag(R) > 0``."""
    gaussian = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    q, r = torch.linalg.qr(gaussian)
    return q * torch.sign(torch.diagonal(r))[None, :]


def rotation(n: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """``hadamard(n)`` when a construction exists, else ``orthogonal(n, seed)``; returns (H, name)."""
    built = hadamard(n)
    return built if built is not None else (orthogonal(n, seed), f"random-orthogonal(seed={seed})")
