"""remat with accelerate on the CPU: plan before prepare, then accelerate's own loop.

    python examples/accelerate_example.py
    accelerate launch --cpu --num_processes 2 examples/accelerate_example.py   # DDP, gloo
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch import nn

from remat.integrations.accelerate_prepare import auto_checkpoint_before_prepare


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), *(nn.Sequential(
        nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
        for _ in range(6)), nn.Linear(32, 1))
    data = [(torch.randn(128, 32), torch.randn(128, 1)) for _ in range(8)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    accelerator = Accelerator(cpu=True)
    done = auto_checkpoint_before_prepare(accelerator, model, "75%",
                                          batch=next(iter(loader)), loss_fn=loss_fn,
                                          stages=[str(i) for i in range(1, 7)], cache=False)
    accelerator.print(done.report)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, batch in enumerate(loader):
        loss = loss_fn(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        accelerator.print(f"step {step}: loss {loss.item():.4f}")
    accelerator.print(f"options {done.plan.options}; region rebuilds: {done.handle.rebuilds}")


if __name__ == "__main__":
    main()
