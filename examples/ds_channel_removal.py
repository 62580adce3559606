"""Differentiable sparsification: gated batch norm, l1 on the gates, export a smaller model."""
import torch
import torch.nn.functional as F

from _common import data, parse
from prunopt.nn import SparseBatchNorm2d, convert_to_sparse_batchnorm, l1_regularizer, remove_channels
from prunopt.train.models import SmallCNN

args = parse(__doc__)
torch.manual_seed(0)
model = convert_to_sparse_batchnorm(SmallCNN())
x, y = data()
gates = [m.gate.alpha for m in model.modules() if isinstance(m, SparseBatchNorm2d)]
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(5 if args.tiny else 300):
    opt.zero_grad()
    (F.cross_entropy(model(x), y) + 0.05 * l1_regularizer(gates)).backward()
    opt.step()
if args.tiny:                                        # too short to close gates: close half of one layer's
    with torch.no_grad():
        gates[0][: gates[0].numel() // 2] = 0.0
model.eval()
small = remove_channels(model, x[:1])
torch.testing.assert_close(small(x[:8]), model(x[:8]), atol=1e-4, rtol=1e-4)
n_big, n_small = (sum(p.numel() for p in m.parameters()) for m in (model, small))
print(f"parameters {n_big} -> {n_small}")
assert n_small < n_big
