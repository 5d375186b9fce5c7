"""``python -m tltrun ...``, e.g. ``torchrun --nproc-per-node 2 -m tltrun train --config train.toml``:
the ``tltrun`` command (``tltrun.cli.main``). Only this entry point imports the CLI."""

from tltrun.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
