"""``python -m lorapack.testbed install|status|prune``: install the testbed (``make testbed``), say where it is, or
remove the cached testbeds of other pins (3.5 GB each)."""

from __future__ import annotations

import argparse
import shutil
import sys

from lorapack.testbed.env import INSTALL_HINT, TestbedError, find_testbed, install, stale_testbeds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lorapack.testbed", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help="install the testbed unless the cache has it")
    p_install.add_argument("--force", action="store_true", help="reinstall even when cached")
    sub.add_parser("status", help="say whether the testbed is installed (exit 0) or how to install it (exit 2)")
    sub.add_parser("prune", help="remove cached testbeds of other pins than this checkout's")
    args = ap.parse_args(argv)
    try:
        if args.command == "install":
            install(force=args.force)
            return 0
        if args.command == "prune":
            stale = stale_testbeds()
            for p in stale:
                shutil.rmtree(p)
                print(f"removed {p}")
            if not stale:
                print("nothing to prune")
            return 0
        tb = find_testbed()
        if tb is None:
            print(f"testbed not installed: {INSTALL_HINT}", file=sys.stderr)
            return 2
        print(f"testbed ready: {tb.root} (vLLM {tb.vllm_version})")
        return 0
    except TestbedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
