"""DDP + PrunAdag on CPU (gloo). Launch: torchrun --nproc_per_node=2 examples/ddp_prunadag.py [--tiny]

Every rank sees another shard of the data; DDP averages the gradients, so every rank's
PrunAdag takes the same step and the replicas stay bit-identical (checked at the end)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import data, parse  # noqa: E402
from prunopt.distributed import end_process_group  # noqa: E402
from prunopt.optim import PrunAdag  # noqa: E402

args = parse(__doc__)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)                                   # same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
ddp = torch.nn.parallel.DistributedDataParallel(model)
weights = [p for p in model.parameters() if p.dim() > 1]
others = [p for p in model.parameters() if p.dim() <= 1]
opt = PrunAdag([dict(params=weights), dict(params=others, prune=False)], lr=0.05, relevant=0.1)
x, y = data(128, seed=1 + rank)                        # each rank its own shard
for _ in range(3 if args.tiny else 100):
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
assert all(torch.equal(gathered[0], g) for g in gathered), "replicas diverged"
if rank == 0:
    print(f"{world} ranks, parameters bit-identical")
# End the group with a barrier and a pause that lets gloo's workers finish releasing the last
# collective's tensors (a release during interpreter shutdown aborts the process).
end_process_group()
