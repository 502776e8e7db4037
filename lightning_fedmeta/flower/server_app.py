"""The ServerApp: reads the run config, then runs :class:`~lightning_fedmeta.flower.server.DeploymentServer`.

Run config (``[tool.flwr.app.config]`` of the app's ``pyproject.toml``, or ``flwr run --run-config``):

    fedmeta-config       path of the fedmeta YAML (the file of ``fedmeta fit --config``; absolute, or relative
                         to the ServerApp's and ClientApps' working folders). Required.
    output-dir           where final_params.pt, server_state.pt, history.json and the checkpoint go ("" = none)
    checkpoint           the per-round checkpoint ("" = <output-dir>/server_checkpoint.pt); a restarted ServerApp
                         resumes from it
    run-key              the key of the clients' state files ("" = the Flower run id; a resumed run keeps the
                         key of its checkpoint)
    reply-timeout        seconds to wait for a round's replies (0 = until every reply or error arrives)
    node-timeout         seconds to wait for every partition's SuperNode
    max-retries          resends to a partition whose node became unavailable (restarted)
    evaluate             run the personalised evaluation (every data.eval_every rounds and after the last)
    partition-sizes      every partition's number of training samples, "n0,n1,...", when you know them: a node
                         claiming another size (e.g. to take all the aggregation weight) is refused ("" = each
                         partition's first answer fixes its size; docs/security.md)

``client-data`` and ``upload-client-state`` are node config (the node owner's choice), not run config.
"""

from __future__ import annotations

import os

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from lightning_fedmeta.flower.config import load_config
from lightning_fedmeta.flower.server import DeploymentServer

__all__ = ["app", "parse_sizes", "server_from_context"]

app = ServerApp()


def server_from_context(grid: Grid, context: Context) -> DeploymentServer:
    """The :class:`DeploymentServer` the run config describes."""
    rc = context.run_config
    path = rc.get("fedmeta-config")
    if not isinstance(path, str) or not path:
        raise ValueError("run config fedmeta-config (the path of the fedmeta YAML config) is missing")
    cfg = load_config(path)
    output_dir = str(rc.get("output-dir") or "") or None
    checkpoint = str(rc.get("checkpoint") or "") or (
        os.path.join(output_dir, "server_checkpoint.pt") if output_dir else None
    )
    reply_timeout = float(rc.get("reply-timeout", 0) or 0) or None
    return DeploymentServer(
        cfg, grid, run_key=str(rc.get("run-key") or "") or str(context.run_id), checkpoint=checkpoint,
        output_dir=output_dir, reply_timeout=reply_timeout, node_timeout=float(rc.get("node-timeout", 300)),
        max_retries=int(rc.get("max-retries", 2)), evaluate=bool(rc.get("evaluate", True)),
        partition_sizes=parse_sizes(rc.get("partition-sizes", "")),
    )


def parse_sizes(text: object) -> list[int] | None:
    """Run config ``partition-sizes`` (``"120,80,95"``) as a list, ``None`` when empty; ``ValueError`` naming
    the setting otherwise."""
    if text in (None, ""):
        return None
    try:
        sizes = [int(part) for part in str(text).split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(n < 0 for n in sizes):
        raise ValueError(f"run config partition-sizes = {text!r} must be comma-separated sample counts >= 0, one per "
                         "partition-id (e.g. \"120,80,95\"), or \"\"")
    return sizes


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train ``trainer.max_steps`` rounds of the configured algorithm on the connected SuperNodes."""
    server_from_context(grid, context).run()
