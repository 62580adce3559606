"""ProbMask weight masks kept inside an annealed budget by BudgetProjection."""
import torch
import torch.nn.functional as F

from _common import data, parse
from prunopt.nn import apply_probmask, finalize_probmask, probmask_scores, remove_probmask
from prunopt.optim import BudgetProjection
from prunopt.schedules import DensitySchedule
from prunopt.train.models import SmallCNN

args = parse(__doc__)
torch.manual_seed(0)
model = SmallCNN()
x, y = data()
steps = 5 if args.tiny else 300
apply_probmask(model)
scores = probmask_scores(model)
score_ids = {id(s) for s in scores}
weights = [p for p in model.parameters() if id(p) not in score_ids]
opt = torch.optim.Adam([{"params": weights, "lr": 1e-3}, {"params": scores, "lr": 5e-2}])
proj = BudgetProjection(scores, DensitySchedule(0.1, 0, steps, power=3))
proj.attach(opt)                                   # projects after every opt.step()
for step in range(steps):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
ones = finalize_probmask(model, 0.1)               # exactly round(0.1 * D) ones
remove_probmask(model)
total = sum(s.numel() for s in scores)
print(f"mask ones: {ones} of {total}")
assert ones == round(0.1 * total)
