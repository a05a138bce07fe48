"""``python -m ucm``: the ucm command line."""

from ucm.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
