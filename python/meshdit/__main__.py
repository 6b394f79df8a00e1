"""The `meshdit` command of the Python package (and ``python -m meshdit``).

`generate` and `api` are Python commands (they run a diffusers pipeline in this process); every
other command (run, serve, gen, inputs, compare, inspect, plan, ...) belongs to the C binary,
which has the same name: it is found as `meshdit serve` would be started (``--binary PATH`` as
the first option, ``$MESHDIT_BIN``, or the first ``meshdit`` on PATH that is not this command)
and replaces this process, arguments unchanged.
"""
from __future__ import annotations

import os
import sys

USAGE = """usage: meshdit generate --model DIR --prompt TEXT [--out FILE.png|.mp4] [options]
       meshdit api --model DIR [--port N] [--host H] [--api-key KEY] [options]
       meshdit COMMAND ...          (run, serve, gen, inputs, compare, inspect, plan: the C binary)

`meshdit generate --help` and `meshdit api --help` list their options (docs/service.md)."""


def _exec_binary(argv: list[str]) -> int:
    from .client import MeshditError
    from .server import find_binary
    binary = None
    if argv and argv[0].startswith("--binary"):
        if argv[0] == "--binary" and len(argv) > 1:
            binary, argv = argv[1], argv[2:]
        elif argv[0].startswith("--binary="):
            binary, argv = argv[0].split("=", 1)[1], argv[1:]
    try:
        exe = find_binary(binary)
    except MeshditError as e:
        cmd = argv[0] if argv else ""
        print(f"{e} ('meshdit {cmd}' is a command of the C binary)", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, [exe] + argv)
    return 1  # not reached


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else None
    if cmd in (None, "-h", "--help", "help"):
        print(USAGE)
        return 0 if cmd else 2
    if cmd in ("generate", "api"):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no torchvision notices
        if cmd == "generate":
            from .generate import main_generate
            return main_generate(argv[1:])
        from .api import main_api
        return main_api(argv[1:])
    return _exec_binary(argv)


if __name__ == "__main__":
    sys.exit(main())
