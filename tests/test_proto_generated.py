"""The committed generated code matches proto/: regenerate and compare."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "proto" / "delayed_pubsub_pb"


def _load_generator() -> object:
    spec = importlib.util.spec_from_file_location("genproto", ROOT / "scripts" / "genproto.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): p.read_text()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_is_current(tmp_path: Path) -> None:
    gen = _load_generator()
    gen.generate(tmp_path / "out")  # type: ignore[attr-defined]
    fresh = _files(tmp_path / "out")
    committed = _files(COMMITTED)
    assert sorted(fresh) == sorted(committed), "generated file set differs: run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert stale == [], f"stale generated code, run `make proto`: {stale}"


def test_wire_names_are_daprs() -> None:
    from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
    from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2

    service = pubsub_pb2.DESCRIPTOR.services_by_name["PubSub"]
    assert service.full_name == "dapr.proto.components.v1.PubSub"
    assert [m.name for m in service.methods] == [
        "Init",
        "Features",
        "Publish",
        "BulkPublish",
        "PullMessages",
        "Pause",
        "Resume",
        "Ping",
    ]
    fields = {f.name: f.number for f in pubsub_pb2.PullMessagesResponse.DESCRIPTOR.fields}
    assert fields == {"data": 1, "topic_name": 2, "metadata": 3, "content_type": 4, "id": 5}
    envelope = {f.name: f.number for f in delayed_pb2.DelayedMessage.DESCRIPTOR.fields}
    # The first five exactly as the Dapr delayed-messaging design has them.
    assert {k: envelope[k] for k in ("topic", "message", "contentType", "metadata", "bulkPublish")} == {
        "topic": 1,
        "message": 2,
        "contentType": 3,
        "metadata": 4,
        "bulkPublish": 5,
    }
