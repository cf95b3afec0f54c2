"""``kvbm`` click group."""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="kvbm")
def main() -> None:
    """kvbm: tiered KV-cache block manager (GPU -> host -> disk -> S3)."""


if __name__ == "__main__":
    main()
