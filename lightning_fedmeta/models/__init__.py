"""Reference models: small MLP/CNN baselines and the field's vision CNNs."""

# the public names of the module this package replaced (models.py), so
# `from lightning_fedmeta.models import X` keeps working
from lightning_fedmeta.models.generation import generate
from lightning_fedmeta.models.hf import HuggingFaceCausalLM
from lightning_fedmeta.models.lora import LoRALinear, LoRAModel, add_lora, lora_parameter_count
from lightning_fedmeta.models.reference import (
    ELU,
    FEMNISTCNN,
    MLP,
    TASKS,
    CharLSTM,
    FedAvgCNN,
    LeNet5,
    LogisticRegression,
    Reshape,
    ResNet18,
    SmallCNN,
    TinyTransformer,
    default_model,
)

__all__ = [
    "FEMNISTCNN",
    "FedAvgCNN",
    "LeNet5",
    "ResNet18",
    "MLP",
    "LogisticRegression",
    "SmallCNN",
    "CharLSTM",
    "TinyTransformer",
    "Reshape",
    "ELU",
    "default_model",
    "TASKS",
    "LoRALinear",
    "LoRAModel",
    "add_lora",
    "lora_parameter_count",
    "generate",
    "HuggingFaceCausalLM",
]
