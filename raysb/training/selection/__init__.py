"""Selection inside raysb's trainer: the strategies, scoring, the selection rounds and the
lockstep exchange and merged loss histogram that keep ranks in step (docs/concepts/architecture.md)."""
