r"""FedMuon (Liu et al., Alg. 2): Muon local steps warm-started from the averaged
momentum, aligned with the global update, ``x <- x - eta [(1 - alpha) UV^T + lambda x + alpha
Delta_G]``.

    python -m experiments.main --config=configs/fedmuon.py --workdir=runs/fedmuon
    python -m experiments.main --config=configs/fedmuon.py:fedmuon_liu_cifar100_resnet18_dir0.1 \
        --workdir=runs/fedmuon_c100

Default preset: embedded digits, alpha = 0.5 and Alg. 2's Muon at lr 0.02 (``M = 0.98 M + G``, no
Nesterov, no shape factor, weight decay 0.01, AdamW at the default AdamW rate 0.003 on biases and
norms: ``presets.default_muon``), final test accuracy 0.9222 (seed 42). ``muon_reference``: the
Muon reference form the default had before (Nesterov, Jordan's shape factor, Adam at the Muon
rate, no weight decay), 0.9639: the box's form reaches less on the digits in 60 rounds.

Presets (configs/presets.py):
* Sec. 7 / Table 2: ``fedmuon_liu_cifar100_{resnet18,vit}_dir{0.6,0.1,0.05}``, alpha 0.5 and the
  Muon of ``presets.fedmuon_liu_muon`` -- Alg. 2 line 7's ``M = beta M + G`` with beta 0.98 (no
  Nesterov, no EMA), ``UV^T`` with no shape factor, Jordan's quintic Newton-Schulz (Sec. 3:
  "five Newton-Schulz iterations"), weight decay 0.01, lr 3e-2 (ResNet-18) / 2e-2 (ViT-Tiny) --
  its list "3e-2, 2e-2, 3e-3" read in the order of its models (3e-3: the fine-tuned
  transformers) --, and AdamW at 3e-4 with (0.9, 0.95) for biases and norms, as for Local
  Muon (``presets.muon_fallback``);
* ``..._exactsvd``: the same with Alg. 2 line 8's exact SVD instead of Newton-Schulz;
* ``fedmuon_liu_fig4_cifar100_vit_dir0.1``: Fig. 4's condition numbers logged;
* Table 5 (CIFAR-100, Dir-0.1): ``fedmuon_liu_table5_{resnet18,vit}_no_mbar`` (A1: clients start
  from zero momentum), ``..._no_deltag`` (A2: alpha = 0), and the right half,
  ``..._sgd_mbar_deltag`` / ``..._adamw_mbar_deltag``: FedMuon's aggregation and alignment over
  momentum SGD (lr 0.1, momentum 0.9, weight decay 0.001: Sec. 7's SGD grid and FedCM's
  momentum; the paper does not give these runs' values) or AdamW (lr 3e-4, (0.9, 0.999),
  weight decay 0.01: its Local AdamW);
* Table 6: ``fedmuon_liu_table6_{resnet18,vit}_alpha{0,0.25,0.5,0.75,0.9}`` and
  ``..._beta{0.8,0.9,0.95,0.98,0.99}``;
* Table 7: ``fedmuon_liu_table7_{resnet18,vit}_noagg`` (= A1) and ``..._agg_m`` (= FedMuon);
  ``Agg-m-SVD`` is ``configs/fedmuon_svd.py:fedmuon_liu_table7_{resnet18,vit}_agg_m_svd``;
* FedPAC (Liu et al.)'s settings (Tables 1/3; FedMuon is FedPAC_Muon's structure) with FedMuon's
  Muon at lr 3e-2: ``cifar100_resnet18``, ``cifar100_vit``, ``tiny_imagenet_resnet18``,
  ``tiny_imagenet_vit`` (Dir-0.1; ``*_dir0.05``, ``*_dir0.5``, ``*_iid``),
  ``c4_llama{60m,130m,350m}``;
* fine-tuning (docs/FINETUNING.md): Table 3 ``swin_t_cifar100``, ``swin_t_tiny_imagenet``
  (Swin-T) and Table 4 ``roberta_lora_{cola,rte,sst2,qqp,mrpc,qnli,mnli}`` (RoBERTa-base + LoRA
  rank 16), alpha 0.5, the Muon above at lr 3e-3 -- the third value of Sec. 7's "3e-2, 2e-2,
  3e-3", read as the fine-tuning rate --, AdamW at 1e-4 for the non-matrix leaves (FedPAC (Liu
  et al.) Table 9's fine-tuning AdamW rate, also used by Local AdamW in these presets).

Reddi et al. 2021's natural-client tasks with this config's default optimizer and options,
clients weighted uniformly: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_uniform``.
"""

from configs import base, presets

_OPTIONS = {"alpha": 0.5, "momentum_aggregation": True}


def muon(lr: float) -> dict:
    """FedMuon (Liu et al.)'s Muon (``presets.fedmuon_liu_muon``)."""
    return presets.fedmuon_liu_muon(lr)


_FEDMUON_LIU = presets.fedmuon_liu_presets(
    {"resnet18": muon(3e-2), "vit_tiny": muon(2e-2)}, _OPTIONS
)
# Table 5 right: the other local optimizers with m-bar and Delta_G (module docstring).
_TABLE5_OPTIM = {
    "sgd": {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9, "weight_decay": 0.001},
    "adamw": presets.FEDPAC_OPTIM["adamw"],
}


def ablations(table_setting) -> dict[str, presets.Preset]:
    """Tables 5-7 of FedMuon (Liu et al.): CIFAR-100, Dir-0.1, one knob changed each."""
    out = {}
    for short in ("resnet18", "vit"):
        reference = table_setting[f"fedmuon_liu_cifar100_{short}_dir0.1"]
        stem5, stem6, stem7 = (f"fedmuon_liu_table{t}_{short}" for t in (5, 6, 7))
        out[f"{stem5}_no_mbar"] = presets.variant(
            reference, options={"momentum_aggregation": False}
        )
        out[f"{stem5}_no_deltag"] = presets.variant(reference, options={"alpha": 0.0})
        for name, optim in _TABLE5_OPTIM.items():

            def other(config, reference=reference, optim=optim):
                config = reference(config)
                presets.set_optim(config, optim)
                return config

            out[f"{stem5}_{name}_mbar_deltag"] = other
        for alpha in (0.0, 0.25, 0.5, 0.75, 0.9):
            out[f"{stem6}_alpha{alpha:g}"] = presets.variant(reference, options={"alpha": alpha})
        for beta in (0.8, 0.9, 0.95, 0.98, 0.99):
            out[f"{stem6}_beta{beta:g}"] = presets.variant(reference, optim={"beta": beta})
        out[f"{stem7}_noagg"] = out[f"{stem5}_no_mbar"]
        out[f"{stem7}_agg_m"] = reference
    return out


PRESETS = {
    "muon_reference": presets.muon_reference(0.98),
    **_FEDMUON_LIU,
    **{  # Alg. 2 line 8: UV^T of an exact SVD
        f"{name}_exactsvd": presets.variant(preset, optim={"orthogonalizer": "svd"})
        for name, preset in _FEDMUON_LIU.items()
        if "_fig4_" not in name
    },
    **ablations(_FEDMUON_LIU),
    **presets.fedpac_presets(muon(3e-2), _OPTIONS),
    # Tables 3-4: Sec. 7's 3e-3 ("3e-2, 2e-2, 3e-3": the third, the fine-tuned transformers);
    # non-matrix leaves AdamW at the fine-tuning AdamW rate 1e-4 (presets.FEDMUON_LIU_FINETUNE_OPTIM).
    **presets.fedmuon_liu_finetune_presets(
        presets.fedmuon_liu_muon(
            presets.FEDMUON_LIU_FINETUNE_MUON_LR, presets.FEDMUON_LIU_FINETUNE_ADAMW_LR
        ),
        _OPTIONS,
    ),
    **presets.reddi_uniform_presets(),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedmuon"
    config.fed.options.alpha = 0.5  # local-global alignment weight on Delta_G
    config.fed.options.momentum_aggregation = True  # clients start from the averaged momentum
    # Alg. 2's Muon at lr 0.02 (base: 0.05): M = 0.98 M + G (Table 6's best), no Nesterov, no
    # shape factor, weight decay 0.01, AdamW at the default AdamW rate on biases and norms.
    presets.set_optim(config, presets.default_muon("fedmuon_liu", 0.02))
    return presets.select(config, arg, PRESETS, "fedmuon")
