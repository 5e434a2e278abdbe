"""remat in Lightning on the CPU: RematCallback plans at the first training batch.

    python examples/lightning_example.py
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from remat.integrations.lightning_callback import RematCallback


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Sequential(
            nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
            for _ in range(6)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor],
                      batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    torch.manual_seed(0)
    data = [(torch.randn(128, 32), torch.randn(128, 32)) for _ in range(8)]
    remat_cb = RematCallback("75%", module="net", cache=False)  # training_step calls self.net
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         callbacks=[remat_cb])
    trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=None))
    assert remat_cb.done is not None
    print(remat_cb.done.report)
    print(f"options {remat_cb.done.plan.options}; "
          f"region rebuilds: {remat_cb.done.handle.rebuilds}")


if __name__ == "__main__":
    main()
