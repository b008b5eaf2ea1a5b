"""The engine core: the continuous-batching scheduler and the loop that drives it.

scheduler.py (Scheduler: StepPlan out, StepResult in) over budget.py (one step's
token and sequence budget), request_table.py (every request's state), blockers.py (what
keeps a running request out of a step, registered by each feature), remote_kv.py (a KV
connector's scheduler half), messages.py (plans and outputs), request_queue.py (the
waiting queue per policy); engine_core.py (schedule -> executor -> update), executor.py
(one rank in-process, or many over sockets), service.py (the process's busy loop) and
metrics.py (its metrics hooks). The KV cache it allocates from is ``services/kv_cache``.
"""
