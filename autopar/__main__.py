"""`python -m autopar demo [...]` runs the demo; anything else goes to `autopar.cli`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "demo":
        from autopar.examples import demo  # sets XLA_FLAGS before JAX starts its backend

        return demo.main(argv[1:])
    try:
        import autopar.cli as cli
    except ImportError as e:
        why = (
            "autopar.cli does not exist yet"
            if isinstance(e, ModuleNotFoundError) and e.name == "autopar.cli"
            else f"importing autopar.cli failed: {e}"
        )
        print(f"autopar: no command line ({why}); `python -m autopar demo` works", file=sys.stderr)
        return 2
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
