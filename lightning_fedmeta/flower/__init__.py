"""lightning_fedmeta on Flower: any registered algorithm, unchanged, on SuperLink / SuperNodes (docs/deploy.md).

``pip install lightning-fedmeta[flower]``. The ServerApp is ``lightning_fedmeta.flower.server_app:app``, the
ClientApp ``lightning_fedmeta.flower.client_app:app``; :func:`write_app` writes a Flower app folder for a
fedmeta YAML config. Importing this package does not import Flower; the two app modules do.
"""

from __future__ import annotations

from pathlib import Path

from lightning_fedmeta.flower.config import DeploymentConfig, load_config
from lightning_fedmeta.flower.state_file import ClientStateFile, default_state_dir

__all__ = ["APP_PYPROJECT", "ClientStateFile", "DeploymentConfig", "default_state_dir", "load_config", "write_app"]

#: the Flower app's pyproject.toml (the same as lightning_fedmeta/flower/app/pyproject.toml)
APP_PYPROJECT = (Path(__file__).parent / "app" / "pyproject.toml")


def write_app(directory: str | Path, config: str | Path, **run_config: object) -> Path:
    """Write a Flower app folder (``pyproject.toml``) whose run config points at the fedmeta YAML ``config``
    (made absolute); keyword arguments set other run-config keys (``output_dir="/runs/x"`` → ``output-dir``).
    Returns the folder, ready for ``flwr run <folder> <connection>``."""
    load_config(config)  # a config the deployment cannot use fails here, naming the option
    values = {"fedmeta-config": str(Path(config).resolve()), **{k.replace("_", "-"): v for k, v in run_config.items()}}
    text = APP_PYPROJECT.read_text()
    for key, value in values.items():
        line = f"{key} = {_toml(value)}"
        lines = text.splitlines()
        hits = [i for i, old in enumerate(lines) if old.split("=")[0].strip() == key]
        if not hits:
            raise ValueError(f"unknown run config key {key!r}; known: fedmeta-config, output-dir, checkpoint, run-key, "
                             "reply-timeout, node-timeout, max-retries, evaluate, partition-sizes (client-data and "
                             "upload-client-state are node config: the node owner's choice)")
        lines[hits[-1]] = line
        text = "\n".join(lines) + "\n"
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(text)
    return folder


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(float(value)) if isinstance(value, float) else str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
