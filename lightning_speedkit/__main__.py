"""``python -m lightning_speedkit`` runs the ``speedkit`` command."""

from lightning_speedkit.cli import main

raise SystemExit(main())
