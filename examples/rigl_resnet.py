"""RigL (prunopt.pruning.DynamicSparseTraining) on a small ResNet from transformers (random weights, no download)."""
import sys

import torch
import torch.nn.functional as F

from _common import parse
from prunopt.pruning import DynamicSparseTraining, Masker

args = parse(__doc__)
try:
    from transformers import ResNetConfig, ResNetForImageClassification
except ImportError:
    print("transformers is not installed; skipping (pip install transformers)")
    sys.exit(0)
torch.manual_seed(0)
config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
model = ResNetForImageClassification(config)
steps = 4 if args.tiny else 200
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
masker = Masker(model, opt)
rigl = DynamicSparseTraining(masker, sparsity=0.8, total_steps=steps, mode="rigl", update_interval=2)
x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))


def closure():                                           # RigL regrows by the gradient of one batch
    return F.cross_entropy(model(pixel_values=x).logits, y)


for _ in range(steps):
    opt.zero_grad()
    closure().backward()
    opt.step(); rigl.step(closure=closure)
print("done:", rigl.__class__.__name__, "at sparsity 0.8")
