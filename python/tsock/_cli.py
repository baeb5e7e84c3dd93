"""The `tsock` command of an installed package: the operators' tools (ls,
stat, rm, gpus, demo; cmd/tsock) are a Go program that `pip install` puts
in tsock/_bin beside the libraries. This console script hands it the
command line and the process (exec): exit status, signals and terminal are
the program's own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

PROGRAM = Path(__file__).resolve().parent / "_bin" / "tsock"


def main() -> None:
    if not os.access(PROGRAM, os.X_OK):
        sys.exit(
            f"tsock: {PROGRAM} is missing: this tsock package was not installed from a wheel or with "
            "`pip install .` (from a checkout: go run ./cmd/tsock)"
        )
    os.execv(PROGRAM, ["tsock", *sys.argv[1:]])


if __name__ == "__main__":
    main()
