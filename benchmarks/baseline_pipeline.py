"""The tutorial's RPC pipeline (seeds 000 and 003), written faithfully: the baseline pipejob is
measured against.

Kept from the tutorial on purpose, since it is what is measured:
- ResNet-50 in two shards built from torchvision's Bottleneck (conv1 .. layer2 | layer3 .. fc),
  each created on its own RPC worker by the master with `rpc.remote`;
- a shard's forward fetches its input RRef (`to_here`), computes under the shard's lock and
  returns its output moved to CPU;
- the master chains micro-batches through RRef proxies (shard 1 `remote`, shard 2
  `rpc_async`), waits for every output, concatenates them, computes one MSE loss against
  one-hot labels, then one `dist_autograd.backward` (all forwards, then all backwards) and one
  `DistributedOptimizer(SGD, lr=0.05)` step;
- TensorPipe with `num_worker_threads=128` and torch's default transports and channels.

What differs: CPU devices; `m` is a micro-batch *count* (the tutorial's code hands its
"number of splits" to `Tensor.split` as the micro-batch *size*); one world serves every count.

One process per rank (0 master, 1 and 2 the shards); `compare.py` starts them:
    python benchmarks/baseline_pipeline.py --rank R --port P --micro-batches 1,2,4,8
The master prints `@@mark m<M>-start/-end` around the measured batches of each count and one
`@@result` line per count."""

from __future__ import annotations

import argparse
import math
import os
import threading

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.optim as optim
from _common import one_hot, result, timed_batches
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
from torchvision.models.resnet import Bottleneck

NUM_CLASSES = 1000


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class ResNetBase(nn.Module):
    def __init__(self, block, inplanes, num_classes=NUM_CLASSES, groups=1, width_per_group=64):
        super().__init__()
        self._lock = threading.Lock()
        self._block = block
        self._norm_layer = nn.BatchNorm2d
        self.inplanes = inplanes
        self.dilation = 1
        self.groups = groups
        self.base_width = width_per_group

    def _make_layer(self, planes, blocks, stride=1):
        norm_layer = self._norm_layer
        downsample = None
        if stride != 1 or self.inplanes != planes * self._block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * self._block.expansion, stride),
                norm_layer(planes * self._block.expansion),
            )
        layers = [
            self._block(
                self.inplanes,
                planes,
                stride,
                downsample,
                self.groups,
                self.base_width,
                self.dilation,
                norm_layer,
            )
        ]
        self.inplanes = planes * self._block.expansion
        for _ in range(1, blocks):
            layers.append(
                self._block(
                    self.inplanes,
                    planes,
                    groups=self.groups,
                    base_width=self.base_width,
                    dilation=self.dilation,
                    norm_layer=norm_layer,
                )
            )
        return nn.Sequential(*layers)

    def parameter_rrefs(self):
        return [RRef(p) for p in self.parameters()]


class ResNetShard1(ResNetBase):
    def __init__(self, device, *args, **kwargs):
        super().__init__(Bottleneck, 64, *args, **kwargs)
        self.device = device
        self.seq = nn.Sequential(
            nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False),
            self._norm_layer(self.inplanes),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            self._make_layer(64, 3),
            self._make_layer(128, 4, stride=2),
        ).to(self.device)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.seq(x)
        return out.cpu()


class ResNetShard2(ResNetBase):
    def __init__(self, device, *args, **kwargs):
        super().__init__(Bottleneck, 512, *args, **kwargs)
        self.device = device
        self.seq = nn.Sequential(
            self._make_layer(256, 6, stride=2),
            self._make_layer(512, 3, stride=2),
            nn.AdaptiveAvgPool2d((1, 1)),
        ).to(self.device)
        self.fc = nn.Linear(512 * self._block.expansion, NUM_CLASSES).to(self.device)

    def forward(self, x_rref):
        x = x_rref.to_here().to(self.device)
        with self._lock:
            out = self.fc(torch.flatten(self.seq(x), 1))
        return out.cpu()


class DistResNet50(nn.Module):
    def __init__(self, split_size, workers, *args, **kwargs):
        super().__init__()
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], ResNetShard1, args=("cpu",) + args, kwargs=kwargs)
        self.p2_rref = rpc.remote(workers[1], ResNetShard2, args=("cpu",) + args, kwargs=kwargs)

    def forward(self, xs):
        out_futures = []
        for x in iter(xs.split(self.split_size, dim=0)):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self):
        remote_params = []
        remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())
        remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())
        return remote_params


def run_master(micro_batches: list[int], batch: int, image: int, warmup: int, batches: int):
    loss_fn = nn.MSELoss()
    labels = one_hot(batch, NUM_CLASSES)
    for m in micro_batches:
        # m micro-batches: the split *size* that gives m of them.
        model = DistResNet50(math.ceil(batch / m), ["worker1", "worker2"])
        opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)

        def step(inputs: torch.Tensor, model=model, opt=opt) -> None:
            with dist_autograd.context() as context_id:
                outputs = model(inputs)
                dist_autograd.backward(context_id, [loss_fn(outputs, labels)])
                opt.step(context_id)

        measured = timed_batches(step, f"m{m}", batch, image, warmup, batches)
        result(
            {
                "system": "baseline",
                "m": m,
                "batch_seconds": measured,
                "samples_per_second": batch * len(measured) / sum(measured),
            }
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--micro-batches", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads in every process")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=128)
    name = "master" if args.rank == 0 else f"worker{args.rank}"
    rpc.init_rpc(name, rank=args.rank, world_size=3, rpc_backend_options=options)
    if args.rank == 0:
        counts = [int(m) for m in args.micro_batches.split(",")]
        run_master(counts, args.batch, args.image, args.warmup, args.batches)
    rpc.shutdown()


if __name__ == "__main__":
    main()
