"""``python -m dpopt``: the ``dpopt`` command line."""

from dpopt.cli import main

if __name__ == "__main__":  # pragma: no cover
    main()
