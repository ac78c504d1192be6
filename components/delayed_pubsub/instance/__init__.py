"""Component instances: one per YAML `metadata.name`, and the registry of those on one socket.

- component.py: `Instance`, one initialized instance (its connection, broker, subscriptions);
- publishing.py: its publish path (`Publisher`), where a publish's Redis failure is retried;
- rollback.py: the storage format it settled at Init and what the rollback window refuses;
- background.py: the loops it runs besides its calls (fire loops, forwarders, gauge, due scan);
- registry.py: `Instances`, by name, with restore from Init records and orphaned subscriptions;
- unavailable.py: the text of a Redis failure on its own calls.
"""

from delayed_pubsub.instance.component import Instance
from delayed_pubsub.instance.registry import Instances

__all__ = ["Instance", "Instances"]
