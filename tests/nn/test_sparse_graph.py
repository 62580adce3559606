"""SparseEdges, SparseAdjacency, balanced_normalize (Lee, DS "other uses")."""
import pytest
import torch

from prunopt.nn import (
    SparseAdjacency,
    SparseEdges,
    adjacency_regularizer,
    balanced_normalize,
    l1_regularizer,
)
from prunopt.reference.gates import sparse_gate_reference


def _max_sum_error(A):
    return max((A.sum(-1) - 1).abs().max().item(), (A.sum(-2) - 1).abs().max().item())


@pytest.mark.parametrize("n", [1, 2, 7, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_normalize_approaches_doubly_stochastic(n, seed):
    g = torch.Generator().manual_seed(seed)
    # strongly unbalanced positive input: row scales over two orders of magnitude
    A = torch.rand(n, n, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, n, dtype=torch.float64)[:, None]
    errs = [_max_sum_error(balanced_normalize(A, k)) for k in (1, 5, 20, 60)]
    assert all(b <= a + 1e-12 for a, b in zip(errs, errs[1:])), errs  # monotone improvement
    assert errs[-1] < 1e-8
    assert errs[2] < 1e-2


def test_balanced_normalize_keeps_zeros_and_batches():
    g = torch.Generator().manual_seed(3)
    A = torch.rand(4, 16, 16, generator=g) * (torch.rand(4, 16, 16, generator=g) < 0.4) + torch.eye(16)
    B = balanced_normalize(A, 80)
    assert torch.equal(B == 0, A == 0)  # sparsity pattern unchanged, exact zeros
    assert B.dtype == torch.float32 and B.shape == A.shape
    assert _max_sum_error(B) < 1e-4
    for k in range(4):  # batched equals one by one
        torch.testing.assert_close(B[k], balanced_normalize(A[k], 80))


def test_balanced_normalize_is_a_fixed_point_on_doubly_stochastic():
    P = torch.eye(5)[torch.tensor([3, 0, 4, 1, 2])]
    M = 0.3 * P + 0.7 * torch.full((5, 5), 0.2)
    torch.testing.assert_close(balanced_normalize(M.double(), 3), M.double())


def test_balanced_normalize_empty_rows():
    A = torch.rand(5, 5) + 0.1
    A[2] = 0
    with pytest.raises(ValueError, match="all-zero row or column"):
        balanced_normalize(A, 5)
    A[:, 2] = 0
    B = balanced_normalize(A, 100, allow_empty=True)
    assert torch.isfinite(B).all() and (B[2] == 0).all() and (B[:, 2] == 0).all()
    keep = torch.tensor([0, 1, 3, 4])
    assert _max_sum_error(B[keep][:, keep]) < 1e-5
    # gradient is finite with an isolated node
    A.requires_grad_(True)
    balanced_normalize(A, 5, allow_empty=True).pow(2).sum().backward()
    assert torch.isfinite(A.grad).all()


@pytest.mark.parametrize(
    "bad, kwargs, exc, match",
    [
        (torch.rand(3, 4), {}, ValueError, "square"),
        (torch.rand(3), {}, ValueError, "square"),
        (-torch.rand(3, 3), {}, ValueError, "non-negative"),
        (torch.rand(3, 3), {"iters": 0}, ValueError, "iters"),
        (torch.rand(3, 3), {"iters": 2.0}, TypeError, "iters"),
        (torch.ones(3, 3, dtype=torch.long), {}, TypeError, "floating"),
        (torch.full((2, 2), float("nan")), {}, ValueError, "non-finite"),
        (torch.zeros(0, 0), {}, ValueError, "empty"),
    ],
)
def test_balanced_normalize_errors(bad, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        balanced_normalize(bad, **kwargs)


def test_balanced_normalize_gradcheck():
    A = (torch.rand(4, 4, dtype=torch.float64) + 0.1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: balanced_normalize(a, 4), (A,))


def test_adjacency_regularizer_value_and_errors():
    A = torch.tensor([[0.25, 0.75], [0.0, 1.0]], dtype=torch.float64, requires_grad=True)
    p = 0.5
    rows = (0.25 ** p + 0.75 ** p) ** (1 / p) + 1.0
    cols = 0.25 + (0.75 ** p + 1.0) ** (1 / p)
    r = adjacency_regularizer(A, p)
    assert r.item() == pytest.approx(0.5 * (rows + cols), rel=1e-12)
    r.backward()
    assert torch.isfinite(A.grad).all() and A.grad[1, 0] == 0  # safe at exact zeros
    for bad in (1.0, 0.0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="0 < p < 1"):
            adjacency_regularizer(A, bad)
    with pytest.raises(ValueError, match="square"):
        adjacency_regularizer(torch.rand(2, 3), 0.5)


def test_sparse_adjacency_starts_uniform_and_is_doubly_stochastic():
    adj = SparseAdjacency(9)
    torch.testing.assert_close(adj.unnormalized(), torch.full((9, 9), 8 / 10))
    torch.testing.assert_close(adj(), torch.full((9, 9), 1 / 9))
    with torch.no_grad():
        adj.alpha.normal_()
    assert _max_sum_error(adj().detach()) < 1e-2  # 20 iterations (default); sparse input converges slower
    adj.iters = 200
    assert _max_sum_error(adj().detach()) < 1e-5


def test_sparse_adjacency_strong_regulariser_gives_exact_zeros_and_gradients_flow():
    torch.manual_seed(0)
    n = 12
    adj = SparseAdjacency(n)
    target = torch.rand(n, n) / n
    opt = torch.optim.Adam(adj.parameters(), lr=0.05)
    for step in range(200):
        opt.zero_grad()
        A = adj()
        loss = 0.01 * (A - target).square().sum() + 1.0 * adjacency_regularizer(A, 0.5)
        loss.backward()
        if step == 0:
            for p in adj.parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
        opt.step()
    A = adj().detach()
    assert (A == 0).double().mean() > 0.5  # exact zeros
    assert adj.density() == pytest.approx((A != 0).double().mean().item())
    nonempty = A.sum(1) > 0
    assert nonempty.all()
    assert _max_sum_error(A) < 1e-3  # still (close to) doubly stochastic


def test_sparse_adjacency_mask_fixes_the_support():
    n = 6
    mask = torch.rand(n, n) < 0.5
    mask |= torch.eye(n, dtype=torch.bool)
    adj = SparseAdjacency(n, mask=mask)
    with torch.no_grad():
        adj.alpha.normal_(0, 0.1)
    A = adj()
    assert (A[~mask] == 0).all() and (A[mask] > 0).all()
    A.sum().backward()
    assert (adj.alpha.grad[~mask] == 0).all()


def test_sparse_adjacency_errors():
    with pytest.raises(ValueError, match="num_nodes"):
        SparseAdjacency(1)
    with pytest.raises(TypeError, match="num_nodes"):
        SparseAdjacency(3.0)
    with pytest.raises(ValueError, match="iters"):
        SparseAdjacency(3, iters=0)
    with pytest.raises(ValueError, match="rgf_alpha"):
        SparseAdjacency(3, rgf_alpha=-1.0)
    with pytest.raises(ValueError, match="mask"):
        SparseAdjacency(3, mask=torch.ones(2, 2, dtype=torch.bool))


def test_sparse_edges_weight_is_eq12_per_receiving_node():
    torch.manual_seed(0)
    e = SparseEdges(7, 5, bias=True)
    w = e.weight
    torch.testing.assert_close(w, sparse_gate_reference(e.alpha.detach(), e.beta.detach(), signed=True))
    x = torch.randn(3, 7)
    torch.testing.assert_close(e(x), x @ w.T + e.bias)
    xs = torch.randn(3, 7, 4, 4)
    torch.testing.assert_close(e(xs), torch.einsum("oi,bihw->bohw", w, xs) + e.bias.view(1, -1, 1, 1),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\(B, 7"):
        e(torch.randn(3, 6))
    for bad in ((0, 3), (3, 0)):
        with pytest.raises(ValueError):
            SparseEdges(*bad)
    with pytest.raises(TypeError):
        SparseEdges(3, 3, bias=1)


@pytest.mark.parametrize("rgf", [True, False])
def test_sparse_edges_l1_prunes_to_exact_zeros_and_finds_the_support(rgf):
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(8, 16, generator=g) * (torch.rand(8, 16, generator=g) < 0.25)
    x = torch.randn(256, 16, generator=g)
    t = x @ w_true.T
    torch.manual_seed(0)
    e = SparseEdges(16, 8, rgf=rgf)
    # SGD as in the paper (Adam's normalised steps shrink every alpha alike
    # instead of letting the threshold overtake the small ones)
    opt = torch.optim.SGD(e.parameters(), lr=0.05, momentum=0.9)
    for _ in range(200):
        opt.zero_grad()
        loss = (e(x) - t).square().mean() + 0.01 * l1_regularizer(e.weight)
        loss.backward()
        opt.step()
    w = e.weight.detach()
    assert e.edge_density() < 0.35  # from ~1.0 at initialisation: exact zeros
    assert ((w != 0) == (w_true != 0)).double().mean() > 0.95  # the true edges survive
    assert torch.isfinite(e.alpha).all() and torch.isfinite(e.beta).all()


def test_sparse_edges_rgf_gradient_reaches_pruned_edges():
    e = SparseEdges(4, 1, rgf=True)
    with torch.no_grad():
        e.alpha.copy_(torch.tensor([[2.0, 0.01, -1.0, 0.02]]))
        e.beta.fill_(-1.0)  # threshold 0.27 * 3.03: edges 1 and 3 pruned
    w = e.weight
    assert w[0, 1] == 0 and w[0, 3] == 0 and w[0, 0] != 0
    e(torch.ones(2, 4)).sum().backward()
    assert e.alpha.grad[0, 1] != 0 and e.alpha.grad[0, 3] != 0  # flows to, not through
    e2 = SparseEdges(4, 1, rgf=False)
    with torch.no_grad():
        e2.alpha.copy_(e.alpha)
        e2.beta.copy_(e.beta)
    e2(torch.ones(2, 4)).sum().backward()
    assert e2.alpha.grad[0, 1] == 0 and e2.alpha.grad[0, 3] == 0


def test_graph_layers_under_torch_compile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    e = SparseEdges(6, 6)
    adj = SparseAdjacency(6, iters=5)
    x = torch.randn(2, 6, 3)

    def f(x):
        A = adj()
        h = torch.einsum("ij,bjk->bik", A, e(x)).relu()
        return h.square().mean() + 0.1 * adjacency_regularizer(A) + 0.01 * l1_regularizer(e.weight) \
            + balanced_normalize(A.detach() + 0.1, 3).sum()

    params = list(e.parameters()) + list(adj.parameters())
    eager = f(x)
    ge = torch.autograd.grad(eager, params)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    gc = torch.autograd.grad(compiled, params)
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)
    for u, v in zip(gc, ge):
        torch.testing.assert_close(u, v, atol=1e-6, rtol=1e-4)


def test_adjacency_regularizer_propagates_nan():
    nan = float("nan")
    assert torch.isnan(adjacency_regularizer(torch.tensor([[nan, 1.0], [1.0, 1.0]])))
    assert torch.isnan(adjacency_regularizer(torch.tensor([[[0.0, 1.0], [1.0, 0.0]], [[1.0, 1.0], [1.0, nan]]])))
    # an all-zero row and column stay zero-safe
    A = torch.tensor([[0.0, 0.0], [0.0, 1.0]], requires_grad=True)
    r = adjacency_regularizer(A, 0.5)
    assert r.item() == 1.0
    (g,) = torch.autograd.grad(r, A)
    assert torch.isfinite(g).all() and g[0, 0] == 0 and g[0, 1] == 0 and g[1, 0] == 0
