"""What the round benchmark runs: workloads (a model on random data), algorithms, cases.

A `Case` is one row group of ``python -m experiments.bench round`` (experiments/bench/rounds.py
says what is measured); every implementation of a case runs on `case_data(case)`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import numpy as np

from fedorth import fed, models
from fedorth.data.federated import make_federated, sample_batch


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model on random inputs: ``models.get_model(model, num_classes=..., **kwargs)``."""

    model: str
    input_shape: tuple[int, int, int]
    num_classes: int
    kwargs: tuple[tuple[str, Any], ...] = ()
    conv: bool = False


WORKLOADS: dict[str, Workload] = {
    # Wide enough to be matmul-bound (FedAvg's 2NN, (200, 200), is overhead-bound at B = 50).
    "mlp": Workload("mlp", (32, 32, 3), 10, (("hidden_sizes", (1024, 1024)),)),
    "lenet5": Workload("lenet5", (28, 28, 1), 10, conv=True),
    "cnn": Workload("cnn", (32, 32, 3), 10, conv=True),
    "vit_tiny": Workload("vit_tiny", (32, 32, 3), 100),
    # Reduced width (16-32-64-128 channels) so that a CPU round takes seconds.
    "resnet18": Workload("resnet18", (32, 32, 3), 10, (("width", 0.25),), conv=True),
    # The papers' scale: FedMuon (Liu et al.) Table 2 trains the full-width ResNet-18 and ViT-Tiny
    # (vit_tiny above, 100 classes) on CIFAR-100 (100 clients, 10% participation, batch 50,
    # K = 50); `--preset targets` runs them at S = 10, K = 50, B = 50.
    "resnet18_cifar100": Workload("resnet18", (32, 32, 3), 100, (("width", 1.0),), conv=True),
    # The smoke-test workload of --quick.
    "mlp_small": Workload("mlp", (8, 8, 1), 10, (("hidden_sizes", (32,)),)),
}

# fedorth algorithm -> local optimizer config (hyperparameters as in the presets' defaults).
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {"name": "sgd", "learning_rate": 0.05},
    "fedpac_muon": {"name": "muon", "learning_rate": 0.02},
    "fedpac_soap": {"name": "soap", "learning_rate": 0.003},
    "fedpac_sophia": {"name": "sophia", "learning_rate": 0.05},
}
FEDPAC_BETA = 0.5  # fedorth.fed.algorithms.fedpac default; the torch peer uses the same
# FedPAC's fed.options.aligned, which every implementation of a case runs (``--aligned``).
ALIGNED = ("theta", "state")
EXAMPLES_PER_CLIENT = 64
PEERS = ("torch", "torch_amp", "jax_loop")
DTYPES = ("float32", "bfloat16")


def make_data(workload: Workload, num_clients: int, *, seed: int = 0):
    """Random inputs ``[M, H, W, C]`` (float32), labels ``[M]``, an even partition."""
    rng = np.random.default_rng(seed)
    total = num_clients * EXAMPLES_PER_CLIENT
    x = rng.standard_normal((total, *workload.input_shape)).astype(np.float32)
    y = rng.integers(0, workload.num_classes, total).astype(np.int32)
    partition = np.split(rng.permutation(total), num_clients)
    return x, y, partition


def build_model(workload: Workload, conv_impl: str | None, dtype: str = "float32") -> models.Model:
    """The workload's model; `dtype` is the computation dtype (``model.dtype``), passed to the
    model factory's ``dtype`` argument when it is not float32."""
    kwargs = dict(workload.kwargs)
    if workload.conv and conv_impl is not None:
        kwargs["conv_impl"] = conv_impl
    if dtype != "float32":
        factory = models.MODELS[workload.model]
        if "dtype" not in inspect.signature(factory).parameters:
            raise ValueError(f"model {workload.model!r} has no dtype argument (model.dtype).")
        kwargs["dtype"] = dtype
    return models.get_model(workload.model, num_classes=workload.num_classes, **kwargs)


@dataclasses.dataclass
class Case:
    """What every implementation of one row group runs."""

    workload_name: str
    algorithm: str
    clients_per_round: int
    local_steps: int
    batch_size: int
    dtype: str = "float32"
    # What runs this case: "fedorth" (one row per strategy × conv_impl × unroll asked for) and
    # peers ("torch", "torch_amp", "jax_loop"); None: fedorth and the --peers.
    impls: tuple[str, ...] | None = None
    # FedPAC's fed.options.aligned (fedorth's default "theta": Theta only, each SOAP round opens
    # with the update-free eigh call; "state": the whole state); the peers run the same.
    aligned: str = "theta"

    @property
    def workload(self) -> Workload:
        return WORKLOADS[self.workload_name]

    @property
    def label(self) -> str:
        """``workload/algorithm/S=..,K=..,B=../dtype`` (notes and messages)."""
        return (
            f"{self.workload_name}/{self.algorithm}/S={self.clients_per_round},"
            f"K={self.local_steps},B={self.batch_size}/{self.dtype}"
        )

    @property
    def num_clients(self) -> int:
        return 2 * self.clients_per_round

    @property
    def optim(self) -> dict[str, Any]:
        return ALGORITHMS[self.algorithm]

    @property
    def aligned_mode(self) -> str | None:
        """``aligned`` where the algorithm aligns optimizer states (FedPAC), else None."""
        return self.aligned if self.algorithm.startswith("fedpac") else None

    def fed_algorithm(self):
        """``fed.get_algorithm`` of the case, in its FedPAC alignment mode."""
        options = {} if self.aligned_mode is None else {"aligned": self.aligned_mode}
        return fed.get_algorithm(self.algorithm, self.optim, **options)

    def batch_fn(self, data, client, key):
        return sample_batch(data, client, key, self.batch_size)


def case_data(case: Case):
    """``((x, y, partition), fed_data)``: the case's random data, as arrays and on device."""
    data = make_data(case.workload, case.num_clients)
    x, y, partition = data
    fed_data = make_federated(
        x,
        y,
        x[: case.batch_size],
        y[: case.batch_size],
        partition,
        name="bench",
        num_classes=case.workload.num_classes,
    )
    return data, fed_data
