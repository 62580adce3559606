"""Interspace pruning: convert a CNN to filter-basis convolutions, prune the coefficients, run sparse inference."""
import torch

from _common import parse
from prunopt.nn import FBConv2d, interspace_report, to_interspace
from prunopt.pruning import Masker, PruningAtInit
from prunopt.train.models import SmallCNN
from _common import data

args = parse(__doc__)
torch.manual_seed(0)
model = SmallCNN()
x, y = data(64)
model = to_interspace(model, sharing="coarse")
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
masker = Masker(model, opt)
pai = PruningAtInit(masker, "magnitude", sparsity=0.9)
pai.prune(batches=[(x, y)])
for _ in range(2 if args.tiny else 50):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step(); pai.step()
model.eval()
with torch.no_grad():
    out = model(x[:1])                     # FBConv2d in eval: the cost model picks sparse eq. 8 or conv2d
report = interspace_report(model, x[:1])
print({k: report[k] for k in ("p_SP", "p_IP") if k in report})
assert any(isinstance(m, FBConv2d) for m in model.modules()) and out.shape == (1, 10)
