"""Deprecation aliases of the modules moved when the package was grouped by concern (CHANGELOG.md); removed in the
release after the one that moved them."""
