"""`python -m bench NAME [args]`: run one benchmark of this folder by name.

python -m bench peers --quick     # side by side with NATS JetStream (bench/peers.py)
python -m bench deliver           # PullMessages delivery of a burst (bench/deliver.py)
python -m bench unary             # unary Publish against the grpc.aio ceiling (bench/unary.py)
python -m bench publish           # publish paths (bench/publish.py)
python -m bench delay             # the delay engine (bench/delay.py)
"""

from __future__ import annotations

import importlib
import sys

NAMES = ("peers", "deliver", "unary", "memory", "publish", "delay", "grpc_ceiling")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in NAMES:
        raise SystemExit(__doc__)
    name = sys.argv[1]
    sys.argv = [f"bench {name}", *sys.argv[2:]]
    importlib.import_module(f"bench.{name}").main()


if __name__ == "__main__":
    main()
