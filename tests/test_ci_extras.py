"""Under CI (``FEDMETA_CI=1``, set by ``.ci/run``) every optional extra the suite has tests for is installed, so
no test that guards itself with ``pytest.importorskip`` is silently skipped there. The ``llm`` extra (transformers,
peft) is installed after the main run, for a second run of the language-model test files (``FEDMETA_CI_LLM=1``):
with transformers installed every Python process pays for it at import, and the main run spawns many."""

from __future__ import annotations

import importlib
import os

import pytest

#: module -> the extra or package that provides it (pyproject.toml, plugins/)
EXTRAS = {
    "flwr": "lightning-fedmeta[flower]",
    "flwr_datasets": "lightning-fedmeta[flower-datasets]",
    "datasets": "lightning-fedmeta[flower-datasets]",
    "opacus": "lightning-fedmeta[test]",
    "markdown": "lightning-fedmeta[docs]",
    "fedmeta_pfedme": "plugins/fedmeta-pfedme",
    "fedmeta_centered_clip": "plugins/fedmeta-centered-clip",
    "fedmeta_rotated_blobs": "plugins/fedmeta-rotated-blobs",
    "fedmeta_quantity_skew": "plugins/fedmeta-quantity-skew",
}


#: the llm extra, promised by CI's second run (FEDMETA_CI_LLM=1) of the files that need it
LLM_EXTRAS = {"transformers": "lightning-fedmeta[llm]", "peft": "lightning-fedmeta[llm]"}


@pytest.mark.skipif(os.environ.get("FEDMETA_CI_LLM") != "1", reason="CI's language-model run (FEDMETA_CI_LLM=1)")
@pytest.mark.parametrize("module", sorted(LLM_EXTRAS))
def test_ci_installs_the_llm_extra_for_its_run(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is not installed in CI's language-model run ({LLM_EXTRAS[module]}): {exc}")


@pytest.mark.skipif(os.environ.get("FEDMETA_CI") != "1", reason="only CI promises every extra (FEDMETA_CI=1)")
@pytest.mark.parametrize("module", sorted(EXTRAS))
def test_ci_installs_every_optional_extra(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is not installed in CI ({EXTRAS[module]}): the tests needing it would be skipped: {exc}")
