"""Tests of the threat model in docs/security.md: each one reproduces a finding of the security review (issue 25)."""
