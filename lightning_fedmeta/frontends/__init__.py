"""The frontends over the round engine: what the Lightning module, the CLI and the callbacks own (docs/design.md)."""
