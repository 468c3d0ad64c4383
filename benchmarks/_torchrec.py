"""TorchRec's DLRM on the same Criteo-format logs as benchmarks/recsys.py, in a virtual
environment of its own that `python_of_torchrec` makes once (~/.cache/pipejob/torchrec-venv):
fbgemm-gpu-cpu's kernels load only beside the torch they were built for (1.9.0: torch 2.14;
1.8.0: torch 2.13, this project's), so TorchRec is pinned with its own torch there and never
touches the project's venv. `--worker` runs in that environment: 2 ranks over gloo, an
EmbeddingBagCollection of the 26 tables in TorchRec's DLRM, DistributedModelParallel with its
planner's plan, the tables stepped by fused rowwise Adagrad in the backward and the dense part
by Adam, from --weights where given (`write_pipejob_weights`: pipejob's at --seed), else
its own drawn after `torch.manual_seed(--seed)`. It reads --logs in the file's
order (benchmarks/recsys.py hands it the lines in the order a 2-trainer HybridJob's trainers
read them), parsing them by itself as DLRM's preprocessing does (an empty field is 0, a
negative count 0): step s takes the file's s-th --batch lines, rank r the r-th half of them.
It prints one JSON line: samples, wall and CPU seconds of all ranks (over steps --warmup + 1
to --until), the held-out AUC after the steps, and the sharding the planner chose."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path
from typing import Any

VENV = Path.home() / ".cache" / "pipejob" / "torchrec-venv"
# fbgemm-gpu-cpu 1.8.0 is built for torch 2.13 (its compatibility table); torchrec 1.8.0 with
# it; their dependencies pinned as they resolved (torchrec names fbgemm-gpu, the CUDA build,
# so it goes in without its dependencies and they are named here).
PINS = [
    "torch==2.13.0",
    "fbgemm-gpu-cpu==1.8.0",
    "numpy==2.4.6",
    "tensordict==0.15.3",
    "torchmetrics==1.0.3",
    "lightning-utilities==0.15.3",
    "packaging==26.4",
    "tqdm==4.70.1",
    "pyre-extensions==0.0.32",
    "typing-inspect==0.9.0",
    "mypy-extensions==1.2.0",
    "cloudpickle==3.1.3",
    "pyvers==0.2.3",
]
TORCHREC = "torchrec==1.8.0"
TABLES = [f"C{i}" for i in range(1, 27)]
RANKS = 2
# The benchmark's DLRM, pipejob's and TorchRec's alike: 13 dense features, tables of DIM
# columns, the bottom MLP's hidden widths (then DIM), the top's (then 1 logit).
DENSE, DIM, BOTTOM, TOP = 13, 16, [64], [64, 32]


def python_of_torchrec(say: object = print) -> Path:
    """The environment's python, made (a few minutes, once) where it is not there yet
    (torch's wheel alone is hundreds of MB where PyPI serves it)."""
    python = VENV / "bin" / "python"
    ready = VENV / "pipejob-pins.txt"
    wanted = "\n".join([*PINS, TORCHREC])
    if ready.exists() and ready.read_text() == wanted:
        return python
    say(f"making TorchRec's environment in {VENV} (once): {TORCHREC}, {', '.join(PINS[:2])}")
    venv.create(VENV, with_pip=True, clear=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *PINS], check=True)
    subprocess.run([*pip, "--no-deps", TORCHREC], check=True)
    probe = "import torch, fbgemm_gpu, torchrec; torch.ops.fbgemm.asynchronous_complete_cumsum"
    subprocess.run([str(python), "-c", probe], check=True)
    ready.write_text(wanted)
    return python


def run(
    logs: str, val: str, args: argparse.Namespace, env: dict[str, str], weights: str = ""
) -> dict:
    """The worker in TorchRec's environment, with `env` (from `weights`, if given: a file of
    `write_pipejob_weights`); its JSON line."""
    python = python_of_torchrec(lambda m: print(m, flush=True))
    command = [str(python), __file__, "--worker", "--logs", logs, "--val", val]
    command += ["--weights", weights] if weights else []
    for name in ("rows", "batch", "steps", "warmup", "until", "seed"):
        command += [f"--{name}", str(getattr(args, name))]
    out = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"TorchRec's DLRM failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_pipejob_weights(path: str, rows: int, seed: int) -> None:
    """The weights pipejob's DLRM starts from at `seed` (benchmarks/recsys.py's one process, a
    HybridJob's trainers and servers), under the names of TorchRec's DLRM, to `path`: the
    same model, but TorchRec's interaction lists its pairs (i, j) with i < j row by row where
    pipejob's lists i > j, so the top MLP's first layer takes its columns in TorchRec's order."""
    import torch

    from pipejob.core.kinds.tables import Table
    from pipejob.trainer.workloads.recsys import DLRM, initial_rows

    torch.manual_seed(seed)
    dense = DLRM(DENSE, DIM, TABLES, BOTTOM, TOP).state_dict()
    vectors = len(TABLES) + 1
    ours = {
        (int(i), int(j)): k for k, (i, j) in enumerate(torch.tril_indices(vectors, vectors, -1).T)
    }
    theirs = torch.triu_indices(vectors, vectors, 1).T
    columns = [*range(DIM), *(DIM + ours[(int(j), int(i))] for i, j in theirs)]
    state = {
        f"model.sparse_arch.embedding_bag_collection.embedding_bags.{t}.weight": initial_rows(
            Table(name=t, rows=rows, dim=DIM, feature=t), seed, 0, rows
        )
        for t in TABLES
    }
    names = {
        "bottom.0": "model.dense_arch.model._mlp.0._linear",
        "bottom.2": "model.dense_arch.model._mlp.1._linear",
        "top.0": "model.over_arch.model.0._mlp.0._linear",
        "top.2": "model.over_arch.model.0._mlp.1._linear",
        "top.4": "model.over_arch.model.1",
    }
    for mine, name in names.items():
        state[f"{name}.weight"] = dense[f"{mine}.weight"]
        state[f"{name}.bias"] = dense[f"{mine}.bias"]
    state["model.over_arch.model.0._mlp.0._linear.weight"] = dense["top.0.weight"][:, columns]
    torch.save(state, path)


# ---- in TorchRec's environment


def parsed(lines: list[bytes], rows: int) -> tuple[Any, Any, Any]:
    """Lines as DLRM's preprocessing reads them: (dense (n, 13), ids (26, n), labels (n,))."""
    import numpy as np
    import torch

    fields = [[x or b"0" for x in line.split(b"\t")] for line in lines]
    labels = torch.tensor([float(f[0]) for f in fields])
    counts = np.array([[int(x) for x in f[1:14]] for f in fields], dtype=np.float64)
    dense = torch.from_numpy(np.log1p(np.maximum(counts, 0.0))).float()
    ids = torch.tensor([[int(x, 16) % rows for x in f[14:40]] for f in fields]).T.contiguous()
    return dense, ids, labels


def batch_of(lines: list[bytes], rows: int) -> Any:
    import torch
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dense, ids, labels = parsed(lines, rows)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=TABLES,
        values=ids.reshape(-1),
        lengths=torch.ones(ids.numel(), dtype=torch.int32),
    )
    return Batch(dense_features=dense, sparse_features=sparse, labels=labels)


def model_of(rows: int) -> Any:
    """TorchRec's DLRM (DLRMTrain: with its BCE loss) over 26 tables, made on the meta device
    (DistributedModelParallel makes every rank's shards), the tables' rowwise Adagrad fused
    into the backward."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=rows, feature_names=[t])
        for t in TABLES
    ]
    tables = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRMTrain(DLRM(tables, DENSE, [*BOTTOM, DIM], [*TOP, 1]))
    apply_optimizer_in_backward(RowWiseAdagrad, tables.parameters(), {"lr": 0.02, "eps": 1e-10})
    return model


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    torch.manual_seed(args.seed)
    model = model_of(args.rows)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=RANKS, compute_device="cpu"))
    plan = planner.collective_plan(model, None, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
    if args.weights:
        load_weights(dmp, args.weights)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=0.001),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    lines = [line for line in Path(args.logs).read_bytes().split(b"\n") if line]
    share = args.batch // RANKS
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            wall, cpu = time.perf_counter(), time.process_time()
        first = (step - 1) * args.batch + rank * share  # the logs in order, cycled
        mine = [lines[(first + k) % len(lines)] for k in range(share)]
        loss, _ = dmp(batch_of(mine, args.rows))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == args.until:
            figures = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    scores = held_out(dmp, args, rank)
    every = [None] * RANKS
    dist.all_gather_object(every, (figures, scores))
    if rank == 0:
        print(json.dumps(summary(every, plan, args)), flush=True)
    dist.destroy_process_group()


def load_weights(dmp: Any, path: str) -> None:
    """`write_pipejob_weights`'s file into every rank's model: a table's rows into the
    shards this rank holds, the dense part whole; the names must be the model's."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    wanted = torch.load(path, weights_only=True)
    state = dmp.state_dict()
    if set(state) != set(wanted):
        raise ValueError(f"{path}: names {sorted(set(state) ^ set(wanted))} do not match")
    with torch.no_grad():
        for name, value in state.items():
            if not isinstance(value, ShardedTensor):
                value.copy_(wanted[name])
                continue
            for shard in value.local_shards():
                (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(wanted[name][r : r + h, c : c + w])


def held_out(dmp: Any, args: argparse.Namespace, rank: int) -> tuple[list[float], list[float]]:
    """This rank's half of the held-out lines: (logits, labels), in batches of --batch."""
    import torch

    lines = [line for line in Path(args.val).read_bytes().split(b"\n") if line]
    lines = lines[: len(lines) // (2 * RANKS) * 2 * RANKS]  # both ranks the same count of batches
    mine = lines[rank::RANKS]
    logits, labels = [], []
    dmp.eval()
    with torch.no_grad():
        for start in range(0, len(mine), args.batch // RANKS):
            _, (_, out, got) = dmp(batch_of(mine[start : start + args.batch // RANKS], args.rows))
            logits += out.reshape(-1).tolist()
            labels += got.reshape(-1).tolist()
    return logits, labels


def auc(scores: list[float], labels: list[float]) -> float:
    """The chance a click outscores a non-click, ties half (as pipejob's recsys.auc)."""
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    positives = sum(1 for y in labels if y == 1)
    negatives = len(labels) - positives
    rank_sum = sum(r for r, y in zip(ranks, labels, strict=True) if y == 1)
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def summary(every: list, plan: Any, args: argparse.Namespace) -> dict:
    scores = [s for _, (logits, _) in every for s in logits]
    labels = [y for _, (_, got) in every for y in got]
    chosen: dict[str, int] = {}
    for module_plan in plan.plan.values():
        for spec in module_plan.values():
            chosen[spec.sharding_type] = chosen.get(spec.sharding_type, 0) + 1
    return {
        "samples": args.batch * (args.until - args.warmup),
        "wall": max(f["wall"] for f, _ in every),
        "cpu": sum(f["cpu"] for f, _ in every),
        "auc": auc(scores, labels),
        "heldOut": len(labels),
        "sharding": ", ".join(f"{n} tables {kind}" for kind, n in sorted(chosen.items())),
    }


def worker(argv: list[str]) -> None:
    import socket

    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--logs", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--weights", default="")
    for name in ("rows", "batch", "steps", "warmup", "until", "seed"):
        ap.add_argument(f"--{name}", type=int, required=True)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(args, port), nprocs=RANKS, start_method="spawn")


if __name__ == "__main__":
    worker(sys.argv[1:])
