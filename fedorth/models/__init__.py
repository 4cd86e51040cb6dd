"""Flax models of the papers, chosen by name: `get_model(name, **kwargs) -> Model`.

| name | model | source |
| --- | --- | --- |
| mlp | ReLU MLP / logistic regression | offline data (FedAvg 2NN) |
| lenet5 | LeNet-5 | FedMuon-LMO §7.1 (FashionMNIST) |
| cnn | FedAvg's CIFAR CNN (conv 32/64, dense 384/192) | docs/PERFORMANCE.md, XLA:CPU traps |
| resnet18 | ResNet-18, CIFAR stem, BN or GN | the four vision papers (GN: FedMuon-LMO) |
| vit_tiny | ViT-Tiny (192/6/3, patch 4) | FedPAC (Liu et al.) Appendix D.4, FedMuon (Liu et al.) |
| vit_zg | CIFAR ViT (512/6/8, patch 4) | FedMuon (Zhang & Gao) Appendix A.1 Table 2 |
| rnn | Elman RNN text classifier (300/4096/2) | Zhang & Gao: FedMuon Table 3, minimax §6 |
| llama | LLaMA decoder (tiny/60m/130m/350m) | FedPAC (Liu et al.) §6.3 (GaLore shapes) |
| auc | any binary classifier under the min-max AUC loss (Eq. 20) | Fed minimax (Zhang & Gao) §5 |
| vit_b16 | ViT-B/16, 224×224, Hugging Face layout | FedPAC (Liu et al.) Table 2/9 |
| swin_t | Swin-T, Hugging Face layout | FedMuon (Liu et al.) Table 3 |
| roberta_base | RoBERTa-base + classifier, Hugging Face layout | FedMuon (Liu et al.) Table 4 |

Conv models take `conv_impl="lax"|"matmul"|"canonical"|"auto"` (default "auto": on CPU the
canonical convolution in the engine's sequential client loop and im2col + dot elsewhere, lax on
other backends; fedorth.models.layers explains why).

Every model takes `dtype="float32"|"bfloat16"` (the config key `model.dtype`): the compute dtype.
In bfloat16 the activations, matrix products and convolutions run in bfloat16, while parameters
(hence gradients, optimizer states and server averages), normalization statistics, softmax, the
loss and the returned logits stay float32 (`fedorth.models.layers.compute_dtype`).
"""

from collections.abc import Callable

from fedorth.models.auc import auc
from fedorth.models.base import Model
from fedorth.models.cnn import cnn
from fedorth.models.lenet import lenet5
from fedorth.models.llama import llama
from fedorth.models.mlp import mlp
from fedorth.models.reddi import emnist_cnn, lstm_lm, multilabel_lr
from fedorth.models.resnet import resnet18
from fedorth.models.rnn import rnn
from fedorth.models.roberta import roberta_base
from fedorth.models.swin import swin_t
from fedorth.models.vit import vit_tiny, vit_zg
from fedorth.models.vit_b16 import vit_b16

MODELS: dict[str, Callable[..., Model]] = {
    "mlp": mlp,
    "lenet5": lenet5,
    "cnn": cnn,
    "resnet18": resnet18,
    "vit_tiny": vit_tiny,
    "vit_zg": vit_zg,
    "rnn": rnn,
    "llama": llama,
    "auc": auc,
    "vit_b16": vit_b16,
    "swin_t": swin_t,
    "roberta_base": roberta_base,
    "emnist_cnn": emnist_cnn,
    "lstm_lm": lstm_lm,
    "multilabel_lr": multilabel_lr,
}


def get_model(name: str, **kwargs) -> Model:
    """Builds the model registered as `name` with keyword arguments `kwargs`.

    Args:
      name: one of `MODELS` (mlp, lenet5, cnn, resnet18, vit_tiny, vit_zg, rnn, llama).
      **kwargs: the factory's keyword arguments (e.g. `num_classes=100`, `norm="group"`).

    Returns:
      A `Model` with `init`, `loss_fn`, `eval_fn`, `predict_fn`, `module` and `task`.
    """
    if name not in MODELS:
        raise ValueError(f"model name={name!r} is unknown; valid names: {sorted(MODELS)}.")
    return MODELS[name](**kwargs)


__all__ = ["MODELS", "Model", "get_model"] + sorted(MODELS)
