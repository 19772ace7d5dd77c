"""A toy Lightning model and each rank's data, shared by the Lightning checks
(tests/mpi/test_lightning_mpi.py on CPU, tests/gpu/lightning_gpu.py on a GPU)."""
import lightning as L
import torch


class Net(L.LightningModule):
    """A two-layer MLP of ``sizes`` (inputs, hidden, outputs), the same
    initial weights on every rank; plain SGD at ``lr`` on the squared error."""

    def __init__(self, sizes=(12, 16, 3), lr=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.Tanh(),
                                       torch.nn.Linear(sizes[1], sizes[2]))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(rank, n, batch, sizes=(12, 16, 3)):
    """This rank's own shard of ``n`` samples in batches of ``batch``, the
    same batches in every epoch."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, sizes[0], generator=g)
    y = torch.randn(n, sizes[2], generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                       batch_size=batch, shuffle=False)
