"""Fine-tuning presets: FedMuon (Liu et al.) Tables 3-4 and FedPAC (Liu et al.) Table 2.

Settings and rates are checked against the papers' text (quoted in configs/presets.py), model
sizes against the published parameter counts, and one round per architecture runs on the tiny
reference checkpoints of tests/fixtures/pretrained (the preset with its model shrunk to the
fixture's shapes, TFDS mock data). tests/test_configs.py dry-builds every preset besides.
"""

import importlib.util
import math
import pathlib

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from safetensors.numpy import load_file

from fedorth import fed, models
from fedorth.train import builders

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
_MODULES: dict[str, object] = {}


def load(name: str):
    """``configs/<name>.py``, imported by path as ``ml_collections.config_flags`` does."""
    if name not in _MODULES:
        spec = importlib.util.spec_from_file_location(
            f"_test_finetune_{name}", ROOT / "configs" / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[name] = module
    return _MODULES[name]


GLUE = ("cola", "rte", "sst2", "qqp", "mrpc", "qnli", "mnli")
# FedMuon (Liu et al.) Tables 3-4 compare these; FedPAC (Liu et al.) Table 2 / Table 9 those.
FEDMUON_METHODS = "fedavg scaffold fedcm fedlada local_adamw local_muon fedmuon".split()
FEDPAC_METHODS = (
    "fedavg scaffold fedcm local_adamw local_sophia local_muon local_soap "
    "fedpac_sophia fedpac_muon fedpac_soap"
).split()
FEDMUON_PRESETS = ["swin_t_cifar100", "swin_t_tiny_imagenet"] + [f"roberta_lora_{t}" for t in GLUE]
FEDPAC_PRESETS = ["vit_base_cifar100", "vit_base_tiny_imagenet"]

# (local lr, weight decay) per method. FedPAC Table 9 (ViT-Base fine-tuning). FedMuon Sec. 7:
# "3e-2, 2e-2, 3e-3" for FedMuon / Local Muon (3e-3: the fine-tuned models); grids only for the
# others, where the presets take Table 9's SGD 0.1 / AdamW 1e-4 (FedLADA: its released code's
# coupled weight decay 0.001).
TABLE9 = {
    "fedavg": (0.1, 0.001),
    "scaffold": (0.1, 0.001),
    "fedcm": (0.1, 0.001),
    "local_adamw": (1e-4, 0.01),
    "local_sophia": (1e-4, 0.01),
    "local_muon": (1e-2, 0.01),
    "local_soap": (1e-3, 0.01),
    "fedpac_sophia": (1e-4, 0.01),
    "fedpac_muon": (1e-2, 0.01),
    "fedpac_soap": (1e-3, 0.01),
}
FEDMUON_FINETUNE = {
    "fedavg": (0.1, 0.001),
    "scaffold": (0.1, 0.001),
    "fedcm": (0.1, 0.001),
    "fedlada": (1e-4, 0.001),
    "local_adamw": (1e-4, 0.01),
    "local_muon": (3e-3, 0.01),
    "fedmuon": (3e-3, 0.01),
}


def test_every_compared_method_has_the_tables_presets():
    for method in FEDMUON_METHODS:
        missing = set(FEDMUON_PRESETS) - set(load(method).PRESETS)
        assert not missing, (method, sorted(missing))
    for method in FEDPAC_METHODS:
        assert not set(FEDPAC_PRESETS) - set(load(method).PRESETS), method


@pytest.mark.parametrize("method", sorted(set(FEDMUON_METHODS) | set(FEDPAC_METHODS)))
def test_presets_hold_the_papers_settings_and_rates(method):
    """The federation of each table and the rate of each method, as the papers write them."""
    module = load(method)
    if method in FEDPAC_METHODS:
        for preset in FEDPAC_PRESETS:
            c = module.get_config(preset)
            got = (c.data.num_clients, c.fed.clients_per_round, c.fed.batch_size)
            assert got == (50, 5, 16), preset  # 50 clients, 10% participation, batch 16
            assert (c.fed.local_steps, c.fed.rounds, c.data.alpha) == (50, 100, 0.1)
            assert (c.data.image_size, c.data.augment, c.data.rand_augment) == (224, True, True)
            assert c.model.name == "vit_b16"
            assert c.model.pretrained == "google/vit-base-patch16-224-in21k"
            assert (c.optim.learning_rate, c.optim.weight_decay) == TABLE9[method], preset
            assert c.optim.schedule == "cosine"
            if method.startswith("fedpac_"):
                assert c.fed.options.beta == 0.5
    if method in FEDMUON_METHODS:
        for preset in FEDMUON_PRESETS:
            c = module.get_config(preset)
            assert (c.fed.local_steps, c.fed.batch_size, c.fed.rounds) == (50, 16, 100), preset
            assert (c.optim.learning_rate, c.optim.weight_decay) == FEDMUON_FINETUNE[method]
            if preset.startswith("swin_t_"):
                # 100 clients, 5% participation, Dir-0.1.
                assert (c.data.num_clients, c.fed.clients_per_round, c.data.alpha) == (100, 5, 0.1)
                assert (c.model.name, c.data.image_size, c.data.augment) == ("swin_t", 224, True)
            else:
                # 4 clients, full participation, Dir-0.8, LoRA rank 16 on query and value.
                assert (c.data.num_clients, c.fed.clients_per_round, c.data.alpha) == (4, 4, 0.8)
                assert c.model.name == "roberta_base" and c.model.pretrained == "roberta-base"
                assert (c.model.lora_rank, tuple(c.model.lora_targets)) == (16, ("query", "value"))
                assert c.data.dataset_kwargs.tokenizer is None  # the user gives the PATH
                assert c.model.num_classes == (3 if preset.endswith("mnli") else 2)
            if method in ("fedmuon", "local_muon"):
                # Muon's non-matrix leaves: AdamW at the table's AdamW rate (presets rule).
                fallback = c.optim.learning_rate * c.optim.fallback_lr_ratio
                assert math.isclose(fallback, 1e-4, rel_tol=1e-12)
                assert (c.optim.beta, c.optim.ema, c.optim.nesterov) == (0.98, False, False)


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _layer(d: int, mlp: int) -> int:
    """One pre-/post-LN transformer layer: Q, K, V, O with biases, 2 LayerNorms, the MLP."""
    return 4 * (d * d + d) + 2 * 2 * d + (d * mlp + mlp) + (mlp * d + d)


def vit_count(classes, *, image=224, patch=16, d=768, layers=12, mlp=3072) -> int:
    tokens = (image // patch) ** 2
    embed = patch * patch * 3 * d + d + d + (tokens + 1) * d  # patches, cls, positions
    return embed + layers * _layer(d, mlp) + 2 * d + d * classes + classes


def roberta_count(classes, *, vocab=50265, positions=514, d=768, layers=12, mlp=3072) -> int:
    embed = vocab * d + positions * d + d + 2 * d  # words, positions, token type, LayerNorm
    head = d * d + d + d * classes + classes  # RoBERTa's classification head
    return embed + layers * _layer(d, mlp) + head


SWIN_T_1000 = 28_288_354  # Swin-T with its ImageNet-1k head (Liu et al. 2021: 28M; timm's count)


def test_formulas_give_the_published_counts():
    # ViT-B/16: 86M (Dosovitskiy et al. 2020, Table 1; timm: 86,567,656 with 1000 classes).
    assert vit_count(1000) == 86_567_656
    # RoBERTa-base for sequence classification, 2 classes: 125M (Liu et al. 2019);
    # transformers' RobertaForSequenceClassification has 124,647,170.
    assert roberta_count(2) == 124_647_170


@pytest.mark.parametrize(
    "method, preset, expected",
    [
        ("fedpac_soap", "vit_base_cifar100", vit_count(100)),
        ("fedpac_muon", "vit_base_tiny_imagenet", vit_count(200)),
        ("fedmuon", "swin_t_cifar100", SWIN_T_1000 - 900 * (768 + 1)),
        ("local_adamw", "swin_t_tiny_imagenet", SWIN_T_1000 - 800 * (768 + 1)),
    ],
)
def test_vision_presets_have_the_published_sizes(method, preset, expected):
    dry = builders.dry_build(load(method).get_config(preset))
    assert dry.input_shape == (224, 224, 3)  # data.image_size: the checkpoint's resolution
    assert _count(dry.params) == expected


@pytest.mark.parametrize("task", ["sst2", "mnli"])
def test_lora_presets_train_r_times_in_plus_out_per_matrix_plus_the_head(task):
    """RoBERTa-base 125M frozen; rank 16 on 12 layers x (query, value), each 768 -> 768, plus
    the classification head: 12 * 2 * 16 * (768 + 768) + (768^2 + 768 + 768 C + C)."""
    config = load("fedmuon").get_config(f"roberta_lora_{task}")
    classes = 3 if task == "mnli" else 2
    dry = builders.dry_build(config)
    adapters = dry.params["adapters"]
    assert len(adapters) == 24
    assert _count(dry.params) == 24 * 16 * (768 + 768) + 768 * 768 + 768 + 768 * classes + classes
    base = {k: v for k, v in config.model.to_dict().items() if not k.startswith("lora_")}
    base.pop("name"), base.pop("pretrained")
    model = models.get_model("roberta_base", **base)
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 8), np.int32))[0]
    assert _count(shapes) == roberta_count(classes)


# ------------------------------------------------------------- one round on the tiny fixtures

TINY = {  # the fixtures' shapes (tests/fixtures/pretrained/*/config.json)
    "vit": dict(patch_size=8, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64),
    "swin": dict(
        patch_size=2, embed_dim=16, depths=(2, 2), num_heads=(2, 4), window_size=4, mlp_ratio=2.0
    ),
    "roberta": dict(
        vocab_size=120, hidden_size=32, num_layers=2, num_heads=4, mlp_dim=64, max_positions=40
    ),
}


def _tiny(config, fixture: str):
    config.model.update(TINY[fixture])
    config.model.pretrained = str(FIXTURES / fixture)
    if fixture != "roberta":
        config.model.image_size = config.data.image_size = 32  # the fixtures' resolution
    config.data.num_clients = 2
    config.data.partition = "iid"
    config.data.dataset_kwargs.max_train = 8
    config.data.dataset_kwargs.max_test = 4
    config.fed.clients_per_round = 2
    config.fed.local_steps = 2
    config.fed.batch_size = 4
    config.fed.rounds = 1
    return config


def _one_round(config):
    with tfds.testing.mock_data(num_examples=8, policy=tfds.testing.MockPolicy.USE_CODE):
        experiment = builders.build(config)
    server = builders.init_server(experiment)
    before = jax.device_get(server)  # the round donates its input state
    after, metrics = experiment.round_fn(server, experiment.data)
    return experiment, before, jax.device_get(after), jax.device_get(metrics)


def _leaf(tree, dotted: str):
    for key in dotted.split("."):
        tree = tree[key]
    return np.asarray(tree)


@pytest.mark.slow  # 10-40 s on the shared 2-core machine: XLA's compile of the round
@pytest.mark.parametrize(
    "method, preset, fixture, query, weight",
    [
        (
            "fedavg",
            "vit_base_cifar100",
            "vit",
            "layer_1.attention.query.kernel",
            "vit.encoder.layer.1.attention.attention.query.weight",
        ),
        (
            "fedavg",
            "swin_t_cifar100",
            "swin",
            "stage_1_block_1.attention.query.kernel",
            "swin.encoder.layers.1.blocks.1.attention.self.query.weight",
        ),
    ],
)
def test_one_round_of_a_vision_preset_on_the_fixture(method, preset, fixture, query, weight):
    """The preset's run starts from the checkpoint's tensors (bit for bit), with a fresh
    100-class head, and one round moves every leaf by a finite amount.

    FedAvg (compiles fastest; every method of the tables shares the setting, test_fairness.py)
    and no RandAugment (its 15 operations double the compile time; test_randaugment.py runs
    it compiled in the batch function).
    """
    config = _tiny(load(method).get_config(preset), fixture)
    config.data.rand_augment = False
    experiment, server, after, metrics = _one_round(config)
    checkpoint = load_file(FIXTURES / fixture / "model.safetensors")
    np.testing.assert_array_equal(_leaf(server.params, query), checkpoint[weight].T)
    assert _leaf(server.params, "head.kernel").shape == (32, 100)  # re-initialized (5 -> 100)
    assert np.isfinite(float(metrics["train_loss"]))
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), after.params, server.params)
    assert all(np.isfinite(v) and v > 0 for v in jax.tree.leaves(moved)), moved


@pytest.mark.slow  # 10-25 s on the shared 2-core machine: XLA's compile of the round
def test_one_round_of_a_lora_preset_on_the_fixture(tmp_path):
    """FedMuon on RoBERTa + LoRA: a missing or oversized tokenizer is a one-line error, the
    frozen base is the checkpoint's, only adapters and head are uploaded, and the adapters' B
    (zero at the start) moves."""
    config = _tiny(load("fedmuon").get_config("roberta_lora_mrpc"), "roberta")
    config.model.lora_rank = 4
    config.model.lora_alpha = 4.0
    config.data.dataset_kwargs.max_len = 24
    with pytest.raises(ValueError, match=r"tokenizer=PATH.*`hf download roberta-base "):
        builders.build(config)  # the preset's placeholder: the message says how to get it
    config.data.dataset_kwargs.tokenizer = _tiny_tokenizer(tmp_path, 400)
    with pytest.raises(ValueError, match=r"has \d+ ids but model.vocab_size=120"):
        builders.build(config)  # ids past the embedding would be clamped silently
    config.data.dataset_kwargs.tokenizer = _tiny_tokenizer(tmp_path, 100)
    experiment, server, after, metrics = _one_round(config)
    checkpoint = load_file(FIXTURES / "roberta" / "model.safetensors")
    frozen = jax.device_get(experiment.data.frozen_params)
    np.testing.assert_array_equal(
        _leaf(frozen, "layer_1.attention.value.kernel"),
        checkpoint["roberta.encoder.layer.1.attention.self.value.weight"].T,
    )
    assert sorted(after.params) == ["adapters", "head", "head_dense"]
    trainable = _count(after.params)
    assert trainable == 2 * 2 * 4 * (32 + 32) + (32 * 32 + 32) + (32 * 2 + 2)
    comm = fed.communication_bytes(experiment.algorithm, server)
    # float32: the update and the aggregated optimizer state -- a momentum for every trainable
    # leaf (Muon's M; the fallback Adam's first moment) and Adam's second moment of the head's
    # two biases (32 + 2 floats, the only non-matrix trainable leaves); down, Delta_G besides.
    # No frozen weight: the base alone has 120 * 32 word embeddings.
    assert comm["bytes_up"] == 4 * (2 * trainable + 32 + 2), comm
    assert comm["bytes_down"] == comm["bytes_up"] + 4 * trainable, comm
    b = np.asarray(after.params["adapters"]["layer_0.attention.query.kernel"]["b"])
    assert np.isfinite(float(metrics["train_loss"])) and float(np.abs(b).max()) > 0


def _tiny_tokenizer(folder: pathlib.Path, vocab_size: int) -> str:
    """A BPE with RoBERTa's special ids and post-processor (<s> A </s></s> B </s>)."""
    from tokenizers import Tokenizer, pre_tokenizers, processors, trainers
    from tokenizers import models as tmodels

    bpe = Tokenizer(tmodels.BPE(unk_token="<unk>"))
    if vocab_size > 256:  # byte level: every byte has an id, as in RoBERTa's
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # characters seen in training, the rest <unk>: fits the fixture's 120 ids
        bpe.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=alphabet,
    )
    bpe.train_from_iterator(["a sentence pair for the glue tasks", "paraphrase or not"], trainer)
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    path = folder / f"tokenizer_{vocab_size}.json"
    bpe.save(str(path))
    return str(path)
