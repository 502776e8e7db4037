"""Evaluation chunks ordered by test-set size, each padded to its own widest client (issue 38: evaluation at the
speed of training on skewed clients)."""

from __future__ import annotations

import torch

from lightning_fedmeta.data.federated import from_client_tensors
from tests.engine.test_local_epochs import _module
from tests.helpers import NUM_CLASSES, make_tiny_clients

TEST_SIZES = [3, 30, 5, 12, 40, 2, 9, 21]


def _evaluator(chunk: int):  # noqa: ANN202
    m = _module({"name": "fedavg", "finetune_steps": 1}, sizes=[8] * 8, batching="vmap", client_chunk_size=chunk)
    clients = make_tiny_clients(8, train_sizes=[8] * 8, test_size=max(TEST_SIZES))
    clients = [(x, y, tx[:n], ty[:n]) for (x, y, tx, ty), n in zip(clients, TEST_SIZES, strict=True)]
    m.attach_data(from_client_tensors(clients, NUM_CLASSES))
    m.engine.run_round(0, torch.optim.SGD(m.model.parameters(), lr=1.0))
    return m.evaluator


def test_chunks_are_ordered_by_test_size_and_padded_to_their_own_widest() -> None:
    ev = _evaluator(chunk=3)
    chunks = ev.chunks(torch.arange(8))
    assert [c.tolist() for c in chunks] == [[4, 1, 7], [3, 6, 2], [0, 5]]
    assert [ev.test_width(c) for c in chunks] == [40, 12, 3]
    padded = sum(c.numel() * ev.test_width(c) for c in chunks)
    assert padded == 3 * 40 + 3 * 12 + 2 * 3 < 8 * 40  # 162 padded rows instead of 320


def test_chunked_scores_equal_one_chunk_in_the_listed_order() -> None:
    clients = torch.tensor([5, 0, 7, 2, 4, 1, 6, 3])
    whole = _evaluator(chunk=100).evaluate_clients(clients, 1)
    chunked = _evaluator(chunk=3).evaluate_clients(clients, 1)
    assert whole.keys() == chunked.keys()
    for key in whole:
        torch.testing.assert_close(chunked[key], whole[key], rtol=1e-6, atol=1e-6)
    assert chunked["total"].tolist() == [float(TEST_SIZES[int(c)]) for c in clients]


def test_scores_in_slabs_of_rows_equal_the_whole_test_set() -> None:
    """score_client with ``rows=4`` (slabs of 4 test rows, sums added in order) against the whole test set at once:
    the same totals exactly, the loss and metric sums to rounding, the same outputs."""
    from lightning_fedmeta.client.functional import Batch
    from lightning_fedmeta.evaluation.scoring import score_client

    ev = _evaluator(chunk=100)
    engine = ev.engine
    client = 4  # 40 test rows
    adapt, state, record, buffers = engine.personal_inputs(client, 1)
    test = engine.gatherer.test_batches(torch.tensor([client]))
    test = Batch(test.x[0], test.y[0], test.mask[0])
    fns = ev.metric.builtin_functions()
    whole = score_client(engine.ctx, engine.algorithm, engine.global_params(), engine.server_state, adapt, test,
                         state, record, fns, keep_outputs=True)
    slabs = score_client(engine.ctx, engine.algorithm, engine.global_params(), engine.server_state, adapt, test,
                         state, record, fns, keep_outputs=True, rows=4)
    assert float(slabs["total"]) == float(whole["total"]) == 40.0
    for key in ("loss_sum", "builtin", "outputs"):
        torch.testing.assert_close(slabs[key], whole[key], rtol=1e-6, atol=1e-6)
