"""Placeholder replaced by the demo CLI."""


def main() -> None:
    raise SystemExit(0)
