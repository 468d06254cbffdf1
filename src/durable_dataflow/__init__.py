"""Durable Dataflow: data pipelines with recovery you can prove."""

__version__ = "0.1.0"
