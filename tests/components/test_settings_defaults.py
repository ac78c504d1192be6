"""A setting's default is declared once, in metadata.yaml; where the middleware must have its own (the
engine and the history writers run without the component), the two are held together here."""

from __future__ import annotations

from delayed_middleware.engine import EngineConfig
from delayed_middleware.history import Retention
from delayed_pubsub.engines import engine_config
from delayed_pubsub.forwarder.config import ForwarderConfig, forwarder_config
from delayed_pubsub.settings import parse_settings

BASE = {"redisHost": "localhost:6379"}


def test_a_component_without_history_or_marker_settings_runs_the_engine_at_its_own_defaults() -> None:
    settings = parse_settings(BASE)
    made, own = engine_config(settings), EngineConfig()
    assert (made.history_max_len, made.history_max_age_ms, made.marker_ttl_ms) == (
        own.history_max_len,
        own.history_max_age_ms,
        own.marker_ttl_ms,
    )
    assert Retention(settings.history_max_len, settings.history_max_age_ms) == Retention()


def test_a_bare_forwarder_config_times_calls_and_claims_as_the_component_default_does() -> None:
    settings = parse_settings(BASE)
    made = forwarder_config(
        dapr_grpc_address="",
        dead_letter_topic="",
        claim_idle_ms=settings.processing_timeout_ms,
        call_timeout_ms=settings.handoff_timeout_ms,
        env={},
    )
    bare = ForwarderConfig()
    assert (made.call_timeout_s, made.claim_idle_ms) == (bare.call_timeout_s, bare.claim_idle_ms)
