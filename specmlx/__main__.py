"""`python -m specmlx`: the same entry point as the `specmlx` command."""

from .cli import main

main()
