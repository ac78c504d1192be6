"""CPU cost of turning history entries into delayed-history rows (Arrow), the Spark reader's hot loop.

    .venv/bin/python bench/history_rows.py [--records 1000000] [--page 10000]

Decodes well-formed `fired` records (every field set, as the engine writes them)
page by page with spark.rows.history_batch, in-process, no Spark and no Redis:
best of 3 in CPU seconds. Run it against another checkout with
PYTHONPATH=DIR/proto:DIR/middleware:DIR/components for a before/after ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components"):
    if str(ROOT / sub) not in sys.path:
        sys.path.append(str(ROOT / sub))  # after PYTHONPATH: another checkout given there wins

from delayed_pubsub.spark.rows import history_batch  # noqa: E402

T0 = 1_790_000_000_000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--page", type=int, default=10_000)
    args = parser.parse_args()
    page = [
        (
            f"{T0 + i}-0".encode(),
            {
                b"event": b"fired",
                b"at": str(T0 + i).encode(),
                b"id": f"m{i}".encode(),
                b"sid": b"",
                b"topic": b"orders",
                b"kind": b"oneshot",
                b"due": str(T0).encode(),
                b"late": b"5",
                b"size": b"300",
                b"attempt": b"1",
                b"reason": b"",
                b"schedule": b"",
            },
        )
        for i in range(args.page)
    ]
    best = float("inf")
    for _ in range(3):
        t = time.process_time()
        for _ in range(args.records // args.page):
            history_batch("app-delayed", page)
        best = min(best, time.process_time() - t)
    print(f"history_batch, {args.records} records in pages of {args.page}: {best:.2f} s CPU (best of 3)")


if __name__ == "__main__":
    main()
