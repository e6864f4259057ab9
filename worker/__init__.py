"""What every worker shares, above the engine and the KV transfer: the worker base (an engine
on its loop thread, the cache-event publisher, health, stats, shutdown; the async base both
Ray actors delegate through) and fault injection for the chaos suite.

Host policy (engine/hosts.py: which listening addresses are refused) stays in engine/: the
TP/EP group store in engine/parallel and the KV rendezvous in kv_transfer bind sockets too,
and neither may import this package.
"""
from worker.base import EngineWorker, Publisher, PublisherFactory, WorkerActor
from worker.faults import FaultInjectionOff, FaultInjector, InjectedFault

__all__ = ["EngineWorker", "FaultInjectionOff", "FaultInjector", "InjectedFault", "Publisher", "PublisherFactory",
           "WorkerActor"]
