"""The gateway's routing core (docs/architecture.md §7): which replica serves a request.

Pure: prefix shares and homes, the load view's numbers, the cost rule (``router``), the
approximate tier's prefix tree (``approx``), how many more requests a replica may be sent
(``admission``), the order queued requests leave a model's queue (``fair_queue``) and the
inputs one decision reads (``inputs``). The gateway's shell passes time and the maps in.
"""
