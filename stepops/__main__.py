"""``python -m stepops COMMAND ...``; see ``python -m stepops --help``."""

from stepops.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
