"""rotated_blobs: the dataset contract (one call of the kit), then what is its own: the rotation and the options.

Run against the INSTALLED distribution (``pip install ./plugins/fedmeta-rotated-blobs``)."""

from __future__ import annotations

import pytest
import torch
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.testing import check_dataset

from fedmeta_rotated_blobs import rotated_blobs


def test_rotated_blobs_keeps_the_contract_of_a_dataset() -> None:
    check_dataset("rotated_blobs", {"num_features": 4, "num_classes": 3, "min_samples": 10, "max_samples": 30})


def test_without_rotation_every_client_shares_the_class_centres() -> None:
    """rotation = 0: R_i = I, so each client's class means estimate the same centres; rotation = 1 moves them."""
    def class_means(rotation: float) -> torch.Tensor:
        data = rotated_blobs(2, seed=3, num_features=3, num_classes=2, min_samples=400, max_samples=400,
                             rotation=rotation, noise=0.1)
        means = []
        for i in range(2):
            x, y = data.client_train(i)
            means.append(torch.stack([x[y == c].mean(0) for c in range(2)]))
        return (means[0] - means[1]).abs().max()

    assert float(class_means(0.0)) < 0.05
    assert float(class_means(1.0)) > 0.5


def test_options_reach_the_dataset_by_name_and_unknown_ones_are_refused() -> None:
    dm = FederatedDataModule(dataset="rotated_blobs", num_clients=3, dataset_options={"num_classes": 5,
                                                                                      "num_features": 6})
    assert dm.num_classes == 5 and dm.federated_data is not None and dm.federated_data.input_shape == (6,)
    with pytest.raises(ValueError, match=r"dataset 'rotated_blobs' has no option\(s\) 'classes'.*accepted: "
                                         r"num_features, num_classes"):
        FederatedDataModule(dataset="rotated_blobs", dataset_options={"classes": 5})
    with pytest.raises(ValueError, match=r"'seed' are set by data\.\* settings \(data\.data_seed\)"):
        FederatedDataModule(dataset="rotated_blobs", dataset_options={"seed": 5})
    with pytest.raises(ValueError, match=r"rotation must be a number in \[0\.0, 1\.0\], got 2"):
        FederatedDataModule(dataset="rotated_blobs", num_clients=2, dataset_options={"rotation": 2}).setup("fit")
