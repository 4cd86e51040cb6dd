r"""Local Muon (seed 004 Alg. 6; seed 000's "Local Muon"; seed 001's LocalMuon): Muon local steps
from a fresh momentum each round, the server averages the parameter updates.

    python -m experiments.main --config=configs/local_muon.py --workdir=runs/local_muon
    python -m experiments.main --config=configs/local_muon.py:cifar100_resnet18 --workdir=...

Muon acts on matrix leaves; biases and norms use Adam scaled by ``fallback_lr_ratio``
(fedorth.fed.local). Default preset: embedded digits, final test accuracy 0.96 (seed 42).

Presets (configs/presets.py):
* seed 004 Tables 1/3 with Table 8/10's Local Muon row (lr 3e-2, momentum 0.9, Adam fallback b2
  0.95, weight decay 0.01): ``cifar100_resnet18``, ``cifar100_vit``, ``tiny_imagenet_resnet18``,
  ``tiny_imagenet_vit`` (Dir-0.1; ``*_dir0.05``), ``c4_llama{60m,130m,350m}``;
* seed 000 Sec. 7: ``seed000_cifar100_{resnet18,vit}_dir{0.6,0.1,0.05}``, lr 3e-2 (ResNet-18) /
  2e-2 (ViT-Tiny) -- its list "3e-2, 2e-2, 3e-3" read in the order of its models --, momentum
  0.98 (Alg. 1), weight decay 0.01;
* seed 001 Appendix G, LocalMuon: ``seed001_{fmnist_lenet5,cifar10_resnet18}_beta{10,0.1}``, Muon
  lr 0.001 with Liu et al.'s per-layer scale 0.2 sqrt(max(m, n)) ("moonlight"), momentum as an EMA
  with weight 0.1 on the gradient. Deviation: seed 001 steps non-matrix leaves with momentum SGD
  (lr 0.1 / 0.01); fedorth's Muon direction uses its Adam fallback there, at lr 0.001.
"""

from configs import base, presets

_MUON = presets.SEED004_OPTIM["muon"]


def _seed000(lr: float) -> dict:
    return {**_MUON, "learning_rate": lr, "beta": 0.98}


_SEED001 = {
    "name": "muon",
    "learning_rate": 0.001,
    "beta": 0.9,
    "ema": True,
    "nesterov": False,
    "shape_scaling": "moonlight",
    "fallback_lr_ratio": 1.0,
}

PRESETS = {
    **presets.seed004_presets(_MUON),
    **presets.seed000_presets({"resnet18": _seed000(3e-2), "vit_tiny": _seed000(2e-2)}),
    **presets.seed001_presets(
        {(d, b): _SEED001 for d in ("fashion_mnist", "cifar10") for b in (10.0, 0.1)}
    ),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "local_muon"
    config.optim.name = "muon"
    config.optim.learning_rate = 0.05  # base: 0.05 (kept)
    config.optim.beta = 0.95  # Muon momentum (Nesterov)
    # One batched Newton–Schulz per group of equal-shape matrices (fedorth.optim.muon.
    # orthogonalize_tree): same directions; slower on CPU, for accelerators (docs/PERFORMANCE.md).
    config.optim.group_shapes = False
    config.optim.fallback_lr_ratio = 1.0  # Adam on biases at the same lr
    return presets.select(config, arg, PRESETS, "local_muon")
