"""``python -m tltsim ...``: the ``tltsim`` command (``tltsim.cli.main``)."""

from tltsim.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
