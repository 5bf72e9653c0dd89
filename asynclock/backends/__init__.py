"""Backend drivers, one module each. Use :func:`asynclock.connect` to pick one by URL."""
