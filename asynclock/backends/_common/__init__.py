"""What several backends share and the core does not need: URL splitting (host lists),
the option reader of a URL's query string, and the check that refuses an asyncio-only
driver under trio (issue 40 item 4: backend-only helpers live with the backends)."""
