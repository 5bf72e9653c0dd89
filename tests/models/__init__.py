"""Promela models of the lease protocols, checked with Spin (docs/proved.md, issue 44)."""
