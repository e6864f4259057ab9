from decode_worker.worker import DecodeWorker

__all__ = ["DecodeWorker"]
