"""A user's own elastic training script in plain PyTorch: a small CNN classifying synthetic 16x16
images, data-parallel with dtjob's data_parallel (torch DDP's drop-in).

    python examples/vision-ddp/train.py --steps 60
Every sample is made from its index (a seeded generator), so the dataset is the same on every
worker without files; the label is which of the four quadrants is brightest, so there is something
to learn. The final weights (full_state_dict) load into a fresh, unwrapped `Net`.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import Dataset

from dtjob.trainer import ElasticSession, data_parallel, full_state_dict


class Quadrants(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(i))
        quadrants = image.mean(0).unfold(0, 8, 8).unfold(1, 8, 8).mean((-1, -2)).flatten()
        return image, quadrants.argmax()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch-size", type=int, default=48)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--log-file", default=None)
    args = parser.parse_args()

    session = ElasticSession(checkpoint_every=args.checkpoint_every, log_file=args.log_file)
    model = data_parallel(Net().to(session.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session.track(model, optimizer)
    data = Quadrants()
    sampler = session.batch_sampler(data, args.global_batch_size)
    for step in session.steps(args.steps):
        images, labels = (torch.stack(t) for t in zip(*[data[i] for i in sampler.indices(step)], strict=True))
        loss = nn.functional.cross_entropy(model(session.to_device(images)), session.to_device(labels))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        session.report(loss)
    weights = full_state_dict(model)  # the plain Net's state dict, on rank 0
    probe = torch.stack([data[i][0] for i in range(8)])
    outputs = model(session.to_device(probe)).detach().cpu()
    if session.rank == 0 and session.checkpoint_dir is not None:
        torch.save(
            {"weights": weights, "probe": probe, "outputs": outputs}, session.checkpoint_dir / "final.pt"
        )
    session.close()
