"""PrunAdag as a drop-in optimizer in a plain training loop, then a posteriori pruning."""
import torch
import torch.nn.functional as F

from _common import data, parse
from prunopt.optim import PrunAdag
from prunopt.pruning import magnitude_prune_
from prunopt.train.models import SmallCNN

args = parse(__doc__)
torch.manual_seed(0)
model = SmallCNN()
x, y = data()
weights = [p for p in model.parameters() if p.dim() > 1]
others = [p for p in model.parameters() if p.dim() <= 1]
opt = PrunAdag([dict(params=weights), dict(params=others, prune=False)], lr=0.05, relevant=0.1)
for step in range(5 if args.tiny else 200):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
magnitude_prune_(weights, sigma=0.9)
kept = sum(int((w != 0).sum()) for w in weights) / sum(w.numel() for w in weights)
print(f"loss {loss.item():.3f}, weights kept after pruning: {kept:.3f}")
assert kept <= 0.11, kept
