r"""FedPAC_SOAP (FedPAC (Liu et al.) Alg. 2 with Appendix Alg. 5): SOAP local steps, aligned
L/R factors (Theta; the Adam moments restart each round), correction with the global direction.

    python -m experiments.main --config=configs/fedpac_soap.py --workdir=runs/fedpac_soap
    python -m experiments.main --config=configs/fedpac_soap.py:cifar100_resnet18 --workdir=...

Default preset: embedded digits on 2 CPU cores, 30 rounds, final test accuracy about 0.96 (seed
42; 0.9583-0.9639 on the CPUs it ran on, docs/PERFORMANCE.md "Figures that depend on the
machine"; FedPAC aligns Theta = {L, R} only, Alg. 2; ``fed.options.aligned="state"``, the whole
state, gave 0.9694). Each round starts with SOAP's update-free step, as Local SOAP's rounds do
(fedorth.optim.soap.soap_align_mask): 0.9611 on the machine where it was 0.9639 with K real steps
per round.

Presets: FedPAC (Liu et al.) Tables 1/3/12/13 with Table 8/10's FedPAC_SOAP row (lr 3e-3, beta 0.5,
betas (0.95, 0.95), weight decay 0.01): ``cifar100_resnet18``, ``cifar100_vit``,
``tiny_imagenet_resnet18``, ``tiny_imagenet_vit`` (Dir-0.1; ``*_dir0.05``, ``*_dir0.5``, ``*_iid``),
``c4_llama60m``, ``c4_llama130m``, ``c4_llama350m`` (configs/presets.py).

Fine-tuning (docs/FINETUNING.md): FedPAC (Liu et al.) Table 2 ``vit_base_{cifar100,tiny_imagenet}``,
Table 9's FedPAC_SOAP row (lr 1e-3, beta 0.5, (0.95, 0.95), wd 0.01).

Reddi et al. 2021's natural-client tasks with this config's default optimizer and options,
clients weighted uniformly: ``reddi_{emnist,shakespeare,stackoverflow,stackoverflow_tags}_uniform``.
"""

from configs import base, presets

PRESETS = {
    **presets.fedpac_presets(presets.FEDPAC_OPTIM["soap"], {"beta": 0.5, "aligned": "theta"}),
    # FedPAC (Liu et al.) Table 2 with Table 9's row: lr 1e-3, (0.95, 0.95), wd 0.01, beta 0.5.
    **presets.fedpac_finetune_presets(
        presets.FEDPAC_FINETUNE_OPTIM["soap"], {"beta": 0.5, "aligned": "theta"}
    ),
    **presets.reddi_uniform_presets(),
}


def get_config(arg: str | None = None):
    config = base.get_base_config()
    config.fed.algorithm = "fedpac_soap"
    config.fed.rounds = 30  # base: 60 (SOAP's basis refresh dominates the CPU time)
    config.checkpoint_every = 10  # base: 20
    config.fed.options.beta = 0.5  # correction weight of g_G (FedPAC (Liu et al.) Alg. 2 line 9)
    config.fed.options.aligned = "theta"  # Alg. 2: align Theta only; "state": whole state
    config.optim.name = "soap"
    config.optim.learning_rate = 0.003
    config.optim.b1 = 0.95
    config.optim.b2 = 0.95
    config.optim.precondition_frequency = 10
    config.optim.weight_decay = 0.0
    return presets.select(config, arg, PRESETS, "fedpac_soap")
