"""The field's CNNs (lightning_fedmeta.models.vision): their published shapes, torchvision's layer names, and
loop = vmap for two SGD steps of unequal clients (the models run batched)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.client.execution import CPU_CONV_CHUNK, choose_batching, run_clients, training_chunk_size
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.data.federated import FederatedData
from lightning_fedmeta.models.reference import FEMNISTCNN, FedAvgCNN, LeNet5, ResNet18

CLIENTS, STEPS, BATCH = 3, 2, 4
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_fedavgcnn_has_pfllib_sizes() -> None:
    # conv 1->32 5x5, conv 32->64 5x5, 1024->512 (28x28: 28-4=24 ->12 -> 8 -> 4; 64*4*4 = 1024), 512->10
    expected = (32 * 25 + 32) + (64 * 32 * 25 + 64) + (1024 * 512 + 512) + (512 * 10 + 10)
    assert _count(FedAvgCNN()) == expected == 582_026
    assert FedAvgCNN(3, 10, image_size=32).fc1[0].in_features == 1600  # PFLlib's dim for CIFAR-10
    assert FedAvgCNN()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="at least 16x16"):
        FedAvgCNN(image_size=12)


def test_femnist_cnn_and_lenet_shapes() -> None:
    femnist = FEMNISTCNN()
    assert femnist.fc1[0].in_features == 7 * 7 * 64 and femnist.fc.out_features == 62
    assert femnist(torch.zeros(2, 1, 28, 28)).shape == (2, 62)
    for size, channels in ((28, 1), (32, 3)):
        lenet = LeNet5(channels, 10, image_size=size)
        assert lenet.classifier[0].in_features == 16 * 5 * 5
        assert lenet(torch.zeros(2, channels, size, size)).shape == (2, 10)


def test_resnet18_loads_torchvision_weights_and_computes_the_same() -> None:
    torch.manual_seed(0)
    reference = torchvision.models.resnet18(num_classes=7).eval()
    ours = ResNet18(num_classes=7, norm="batch", stem="imagenet").eval()
    ours.load_state_dict(reference.state_dict())  # strict: every name and shape is torchvision's
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(ours(x), reference(x), atol=1e-5, rtol=1e-5)
    assert _count(ours) == _count(reference)


def test_resnet18_group_norm_and_cifar_stem() -> None:
    model = ResNet18(num_classes=10, norm="group", stem="cifar")
    assert isinstance(model.layer2[0].bn1, nn.GroupNorm) and model.layer2[0].bn1.num_groups == 2
    assert model.conv1.kernel_size == (3, 3) and isinstance(model.maxpool, nn.Identity)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="norm"):
        ResNet18(norm="layer")  # type: ignore[arg-type]


def _batches(shape: tuple[int, ...], classes: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(CLIENTS, STEPS, BATCH, *shape, generator=g)
    y = torch.randint(0, classes, (CLIENTS, STEPS, BATCH), generator=g)
    mask = torch.ones(CLIENTS, STEPS, BATCH)
    for c in range(CLIENTS):  # unequal clients: client c has BATCH - c real samples per step
        mask[c, :, BATCH - c:] = 0
    return Batch(x, y, mask)


@pytest.mark.parametrize("build, shape, classes", [
    (lambda: FedAvgCNN(), (1, 28, 28), 10),
    (lambda: FEMNISTCNN(num_classes=5), (1, 28, 28), 5),
    (lambda: LeNet5(3, 10, image_size=32), (3, 32, 32), 10),
    (lambda: ResNet18(num_classes=4, norm="group", stem="cifar"), (3, 8, 8), 4),
], ids=["fedavgcnn", "femnist", "lenet5", "resnet18-gn"])
def test_loop_equals_vmap(build, shape: tuple[int, ...], classes: int) -> None:
    torch.manual_seed(0)
    model = build()
    assert choose_batching(model, "auto")[0] == "vmap"
    ctx = ClientContext(model, per_sample_loss=lambda out, y: F.cross_entropy(out, y, reduction="none"))

    def client(params, batches):
        for step in range(STEPS):
            params, _ = ctx.sgd_step(params, batches.at(step), 0.1)
        return params

    start = {k: v.detach() for k, v in model.named_parameters()}
    batches = _batches(shape, classes)
    looped, batched = (run_clients(client, (start,), (batches,), CLIENTS, mode) for mode in ("loop", "vmap"))
    for name in looped:
        torch.testing.assert_close(batched[name], looped[name], **TOL, msg=name)
    last = list(looped)[-2]  # the output layer's weight
    assert not torch.allclose(looped[last][0], looped[last][1])  # unequal clients really differ


def test_convolutional_models_train_in_chunks_of_ten_on_the_cpu() -> None:
    cnn, mlp = FedAvgCNN(), nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    cpu = torch.device("cpu")
    assert training_chunk_size(cnn, cpu, "auto") == CPU_CONV_CHUNK == 10
    assert training_chunk_size(mlp, cpu, "auto") == 100
    # a number (or None: all at once) is used as given, convolutions or not (issue 38)
    assert training_chunk_size(cnn, cpu, 100) == 100 and training_chunk_size(cnn, cpu, 4) == 4
    assert training_chunk_size(cnn, cpu, None) is None and training_chunk_size(mlp, cpu, None) is None
    assert training_chunk_size(cnn, torch.device("cuda"), "auto") == 100  # GPUs: 100 (no GPU needed)


def test_chunked_vmap_equals_the_loop_for_a_cnn() -> None:
    torch.manual_seed(0)
    model = FedAvgCNN()
    ctx = ClientContext(model, per_sample_loss=lambda out, y: F.cross_entropy(out, y, reduction="none"))

    def client(params, batches):
        for step in range(STEPS):
            params, _ = ctx.sgd_step(params, batches.at(step), 0.1)
        return params

    start = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(2)
    clients = 7
    batches = Batch(torch.randn(clients, STEPS, BATCH, 1, 28, 28, generator=g),
                    torch.randint(0, 10, (clients, STEPS, BATCH), generator=g), torch.ones(clients, STEPS, BATCH))
    looped = run_clients(client, (start,), (batches,), clients, "loop")
    for chunk in (3, None):  # chunks of 3 (the last one partial) and all clients in one call
        batched = run_clients(client, (start,), (batches,), clients, "vmap", chunk)
        for name in looped:
            torch.testing.assert_close(batched[name], looped[name], **TOL, msg=f"{name}, chunk {chunk}")


def test_the_round_engine_trains_a_cnn_in_chunks_of_ten_and_an_mlp_as_asked() -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.arange(4) * 4  # 3 clients of 4 samples each, train and test
    data = FederatedData(torch.rand(12, 1, 28, 28, generator=g), torch.randint(0, 10, (12,), generator=g), counts,
                         torch.rand(12, 1, 28, 28, generator=g), torch.randint(0, 10, (12,), generator=g), counts, 10)
    for model, expected in ((FedAvgCNN(), CPU_CONV_CHUNK), (nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), 100)):
        module = FederatedModule(model, {"name": "fedavg", "local_steps": 1, "batch_size": 2}, clients_per_round=2)
        module.attach_data(data)
        assert module.engine.training_chunk == expected  # client_chunk_size="auto"
