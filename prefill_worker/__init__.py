from prefill_worker.worker import PrefillWorker

__all__ = ["PrefillWorker"]
