"""A DataLoader with worker processes and a DistributedSampler: each rank's loader forks two workers (from
the script's process, itself a fork in meshrun's warm workers) every epoch."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Squares(Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        x = torch.full((8,), float(i % 17) / 17)
        return x, x.sum(dim=0, keepdim=True) ** 2


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Squares()
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler, num_workers=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        print(f"rank {dist.get_rank()} epoch {epoch} loss {loss.item():.6f}")
    digest = hash(tuple(round(x, 6) for p in model.parameters() for x in p.detach().flatten().tolist()))
    print(f"final-digest {digest & 0xFFFFFFFF:08x}")
    dist.destroy_process_group()
