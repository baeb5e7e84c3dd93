"""`python -m tsock ARGS` is the `tsock` command (see _cli.py)."""

from tsock._cli import main

main()
