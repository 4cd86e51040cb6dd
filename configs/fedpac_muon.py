r"""FedPAC_Muon (FedPAC (Liu et al.) Alg. 2 with Appendix Alg. 7): Muon local steps
warm-started from the averaged momentum (alignment), ``x <- x - eta [(1 - beta) UV^T + beta
g_G]`` (correction).

    python -m experiments.main --config=configs/fedpac_muon.py --workdir=runs/fedpac_muon
    python -m experiments.main --config=configs/fedpac_muon.py:cifar100_resnet18 --workdir=...

Default preset: embedded digits with Alg. 7's Muon at lr 0.02 (EMA momentum 0.9, no Nesterov, no
shape factor, weight decay 0.01, AdamW at the default AdamW rate 0.003 on biases and norms:
``presets.default_muon``), FedPAC aligning Theta = {m} of the matrix leaves only (Alg. 2, the
AdamW fallback restarting each round): final test accuracy 0.9806 (seed 42), as with the Muon
reference form it ran before (``muon_reference``: Nesterov, Jordan's shape factor, Adam at the
Muon rate).

Presets: Tables 1/3/12/13 with Table 8/10's FedPAC_Muon row (lr 3e-2, beta 0.5, momentum 0.9,
weight decay 0.01): ``cifar100_resnet18``, ``cifar100_vit``, ``tiny_imagenet_resnet18``,
``tiny_imagenet_vit`` (Dir-0.1; ``*_dir0.05``, ``*_dir0.5``, ``*_iid``),
``c4_llama{60m,130m,350m}`` (configs/presets.py). The Muon is Local Muon's
(``presets.FEDPAC_OPTIM["muon"]``): Alg. 7 line 6's EMA ``M <- beta1 M + (1 - beta1) G`` (no
Nesterov), Alg. 6 line 29's quintic coefficients (Alg. 7 line 24 writes the cubic
``X (3I - A) / 2``: an inconsistency of the paper, resolved for both methods alike), the
"optional" gamma(m, n) of line 9 left out (``shape_scaling="sqrt_ratio"`` gives its
sqrt(m/n)), and AdamW at Table 8's AdamW rate 3e-4 with the Muon row's (0.9, 0.95) for biases
and norms.

Fine-tuning (docs/FINETUNING.md): FedPAC (Liu et al.) Table 2 ``vit_base_{cifar100,tiny_imagenet}``,
Table 9's FedPAC_Muon row (lr 1e-2, beta 0.5, beta1 0.9, wd 0.01), AdamW at Table 9's 1e-4 for
biases and norms.

Reddi et al. 2021's natural-client tasks with this config's default optimizer and options,
clients weighted uniformly: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_uniform``.
"""

from configs import base, presets

PRESETS = {
    "muon_reference": presets.muon_reference(0.9),
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["muon"], {"beta": 0.5, "aligned": "theta"}),
    # FedPAC (Liu et al.) Table 2 with Table 9's row: lr 1e-2, beta1 0.9, wd 0.01, beta 0.5.
    **presets.fedpac_finetune_presets(
        presets.FEDPAC_FINETUNE_OPTIM["muon"], {"beta": 0.5, "aligned": "theta"}
    ),
    **presets.reddi_uniform_presets(),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedpac_muon"
    config.fed.options.beta = 0.5  # correction weight of g_G
    config.fed.options.aligned = "theta"  # Alg. 2: align Theta only; "state": whole state
    # Alg. 7's Muon at lr 0.02 (base: 0.05): EMA momentum 0.9 (Table 8's beta1), no Nesterov,
    # no shape factor, weight decay 0.01, AdamW at the default AdamW rate on biases and norms.
    presets.set_optim(config, presets.default_muon("fedpac", 0.02))
    # One batched Newton–Schulz per group of equal-shape matrices (fedorth.optim.muon.
    # orthogonalize_tree): same directions; slower on CPU, for accelerators (docs/PERFORMANCE.md).
    config.optim.group_shapes = False
    return presets.select(config, arg, PRESETS, "fedpac_muon")
